"""A Lingvo experiment module written to a folder, as the fixtures of Lingvo's
own experiments use it (flagship_testlib, mt_testlib): the environment of a
subprocess that runs it, its in-process registration, a module fixture.
"""

import os
import sys


def Env(root, **extra):
  """The environment of a subprocess that runs the experiment in `root`."""
  return dict(os.environ, PYTHONPATH=str(root), **extra)


def Register(root, module):
  """Imports experiment `module` from `root` in-process (its classes
  register themselves)."""
  if str(root) not in sys.path:
    sys.path.insert(0, str(root))
  from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
  registry.ImportModule(module)


def Fixture(tmp_path_factory, name, write, module):
  """A module fixture's body: a folder `name`, written by `write(root)` and
  registered; off sys.path again after the module."""
  root = tmp_path_factory.mktemp(name)
  write(root)
  Register(root, module)
  yield root
  sys.path.remove(str(root))
