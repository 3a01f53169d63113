"""Shared test set-up: the repository on sys.path, lingvo_ext imported.

Under pytest-xdist (scripts/test.sh), a session or module fixture runs once
per worker; SharedOnce builds an expensive one (a trainer run) once in all,
the other workers waiting on a file lock and reusing its result.
"""

import collections
import fcntl
import gc
import json
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# XLA's compiled cells (lingvo_ext/xla_cache.py) are kept in a folder of this
# run's, shared by its workers and the programs they start, not in ~/.cache:
# set before TensorFlow is imported, which reads the flag once. The pytest
# process that made it removes it at exit.
_XLA_OWNER = 'LINGVO_EXT_TEST_XLA_CACHE_OWNER'
if 'TF_XLA_FLAGS' not in os.environ:
  import atexit
  import tempfile
  _xla_dir = tempfile.mkdtemp(prefix='lingvo_ext_test_xla_')
  os.environ['TF_XLA_FLAGS'] = (
      '--tf_xla_persistent_cache_directory=' + _xla_dir)
  os.environ[_XLA_OWNER] = str(os.getpid())
  atexit.register(
      lambda: os.environ.get(_XLA_OWNER) == str(os.getpid()) and
      shutil.rmtree(_xla_dir, ignore_errors=True))
# pylint: disable=g-import-not-at-top
from lingvo_ext import entry_point  # pylint: disable=unused-import
from tests.support import ROOT as _ROOT
from tests.support import lingvo_lm_testlib
from tests.support import zygote
# pylint: enable=g-import-not-at-top


class TrainedRun:
  """A finished `python -m lingvo_ext.trainer` run that tests continue.

  Each test goes on from its own copy (Copy), so the run stays as it was
  for the others.
  """

  def __init__(self, logdir, model, flags, output):
    self.logdir, self.model, self.flags = logdir, model, flags
    self.output = output

  def Copy(self, dst):
    """Copies the logdir to dst, its checkpoint list pointing into dst."""
    shutil.copytree(self.logdir, dst)
    state = os.path.join(dst, 'train', 'checkpoint')
    with open(state) as f:
      text = f.read()
    with open(state, 'w') as f:  # Absolute paths (older state files), if any.
      f.write(text.replace('"%s/' % self.logdir, '"%s/' % dst))
    return dst


def _SharedOnce(tmp_path_factory, name, build):
  """build(path)'s JSON result, built once for all pytest-xdist workers.

  A module fixture runs once per worker that gets one of its tests; an
  expensive one (a trainer run) goes through here instead: the first worker
  builds it under `name` in the run's shared temp folder while the others
  wait on a file lock, then read its result (the pattern pytest-xdist
  documents). build must leave `path` as the tests expect it, read-only.
  """
  # The parent of this worker's basetemp is shared by all workers of a run.
  # (Without pytest-xdist, -p no:xdist, the basetemp itself.)
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    shared = shared.parent
  path = str(shared / name)
  done = path + '.json'
  with open(path + '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
    if not os.path.exists(done):
      result = build(path)
      with open(done, 'w') as f:
        json.dump({'result': result}, f)
    with open(done) as f:
      return json.load(f)['result']


@pytest.fixture(scope='session', autouse=True)
def _jit_choice_cache(tmp_path_factory):
  """jit_compile='auto' caches its choices in the run's temp folder (shared
  by the workers and the programs they start), not in ~/.cache."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    shared = shared.parent
  os.environ['XDG_CACHE_HOME'] = str(shared / 'xdg_cache')
  _SeedMemoryConstants()


# The memory model's constants in the tests' cache: the suite's runs do not
# spend minutes probing this machine (tests/planner/test_memory_model.py
# tests the probe's cache; bench/memory.py measures the model against real
# runs with this machine's own).
TEST_MEMORY_CONSTANTS = dict(runtime_bytes=900 * 2**20,
                             activation_factor=1.25, bytes_per_op=12288.)


def _SeedMemoryConstants():
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  for n in range(1, 9):
    memory_probe.Seed(n, dict(TEST_MEMORY_CONSTANTS, probe='tests'))
