"""Importing lingvo_ext leaves oneDNN to the user and TensorFlow's default."""

import os
import subprocess
import sys

import pytest
from tests.support import ROOT as _REPO


_PROBE = ('import os, sys; import lingvo_ext; '
          'loaded = "tensorflow" in sys.modules; '
          'from tensorflow.python.util import _pywrap_util_port as port; '
          'print(loaded, os.environ.get("TF_ENABLE_ONEDNN_OPTS"), '
          'port.IsMklEnabled())')


def _Run(code, **env_overrides):
  env = {k: v for k, v in os.environ.items() if k != 'TF_ENABLE_ONEDNN_OPTS'}
  env.update(env_overrides)
  return subprocess.run([sys.executable, '-c', code], cwd=_REPO, env=env,
                        capture_output=True, text=True, check=True)


@pytest.mark.e2e
def test_import_does_not_set_onednn():
  loaded, setting, _ = _Run(_PROBE).stdout.split()
  assert (loaded, setting) == ('False', 'None')


@pytest.mark.e2e
@pytest.mark.parametrize('setting,enabled', [('0', 'False'), ('1', 'True')])
def test_users_setting_wins(setting, enabled):
  out = _Run(_PROBE, TF_ENABLE_ONEDNN_OPTS=setting).stdout.split()
  # TensorFlow loads after lingvo_ext and sees the user's choice.
  assert out == ['False', setting, enabled]


_MARK = '-- tensorflow imported --'


@pytest.mark.e2e
@pytest.mark.parametrize('setting', [None, '0', '1'])
def test_importing_after_tensorflow_is_quiet(setting):
  # TensorFlow itself may print its oneDNN notice (where the CPU's default is
  # on) before the mark; lingvo_ext, imported after it, must print nothing.
  env = {} if setting is None else {'TF_ENABLE_ONEDNN_OPTS': setting}
  r = _Run('import sys, tensorflow; print(%r, file=sys.stderr, flush=True); '
           'print(%r, flush=True); import lingvo_ext' % (_MARK, _MARK), **env)
  assert r.stdout.splitlines() == [_MARK]
  assert r.stderr.splitlines().count(_MARK) == 1
  assert r.stderr.split(_MARK + '\n', 1)[1] == ''


# --- The house: no import cycle, no import from a lower floor up ------------


def test_no_import_cycle():
  from tests import import_graph  # pylint: disable=g-import-not-at-top
  assert import_graph.Cycles(import_graph.Edges()) == []


def test_no_upward_import():
  """docs/architecture.md's floors: each file imports its floor and below."""
  from tests import import_graph  # pylint: disable=g-import-not-at-top
  assert import_graph.Violations(import_graph.Edges()) == []


def test_every_folder_is_on_one_floor():
  """FLOORS names each folder and module right under the packages once."""
  from tests import import_graph  # pylint: disable=g-import-not-at-top
  assert import_graph.Unplaced(import_graph.Files()) == []


def test_the_graph_sees_cycles_and_upward_imports():
  from tests import import_graph  # pylint: disable=g-import-not-at-top
  edges = {'lingvo_ext/core/a.py': {'lingvo_ext/core/b.py'},
           'lingvo_ext/core/b.py': {'lingvo_ext/core/a.py',
                                    'lingvo_ext/trainer.py'},
           'lingvo_ext/trainer.py': set()}
  assert import_graph.Cycles(edges) == [['lingvo_ext/core/a.py',
                                         'lingvo_ext/core/b.py']]
  assert import_graph.Violations(edges) == [('lingvo_ext/core/b.py',
                                             'lingvo_ext/trainer.py')]
  # The floor is the folder's, however deep the file: the engine reaching
  # the planner runs upward, as the planner did when it lived in core/.
  real = import_graph.Edges()
  real['lingvo_ext/core/engine/records.py'].add('lingvo_ext/planner/plans.py')
  assert import_graph.Violations(real) == [(
      'lingvo_ext/core/engine/records.py', 'lingvo_ext/planner/plans.py')]
  # The real graph has the imports it should, function-level ones too: the
  # planner reads the registry; the trainer runs --plan=auto in a function.
  assert 'lingvo_ext/registry.py' in real[
      'lingvo_ext/planner/tf_profiling.py']
  assert 'lingvo_ext/planner/auto.py' in real['lingvo_ext/trainer.py']
  # The registry looks experiments up and nothing more: building params
  # (the Lingvo rewrite, overrides, the dtype) is tasks/experiment_params.py.
  assert {f.split('/')[1] for f in real['lingvo_ext/registry.py']} <= {
      '__init__.py', '_internal'}


def test_floors_name_folders_not_files_in_them():
  from tests import import_graph  # pylint: disable=g-import-not-at-top
  files = import_graph.Files() + ['lingvo_ext/newwing/x.py']
  assert import_graph.Unplaced(files) == ['lingvo_ext/newwing/: on no floor']
  with pytest.raises(ValueError, match='add lingvo_ext/newwing/ to FLOORS'):
    import_graph.Floor('lingvo_ext/newwing/x.py')
  floors = import_graph.FLOORS
  try:
    import_graph.FLOORS = floors + (('lingvo_ext/tools/plan.py',
                                     'lingvo_ext/gone/'),)
    assert import_graph.Unplaced(import_graph.Files()) == [
        'lingvo_ext/tools/plan.py: not a folder or module right under its '
        'package', 'lingvo_ext/gone/: no file lies there']
    import_graph.FLOORS = floors + (('lingvo_ext/core/',),)
    assert import_graph.Unplaced(import_graph.Files()) == [
        'lingvo_ext/core/: listed twice']
  finally:
    import_graph.FLOORS = floors


def test_old_import_paths_give_the_moved_modules():
  # Every old path of lingvo_ext/_moved.py, in a fresh interpreter: the
  # module under its new path, one object (not a second copy).
  code = (
      'import importlib, lingvo_ext\n'
      'from lingvo_ext import _moved\n'
      'for old, new in sorted(_moved.MOVED.items()):\n'
      '  a = importlib.import_module(old)\n'
      '  assert a is importlib.import_module(new), (old, new)\n'
      '  parent, _, leaf = old.rpartition(".")\n'
      '  if parent:  # A top-level old name (params) has none.\n'
      '    assert getattr(importlib.import_module(parent), leaf, a) is a, old\n'
      'print(len(_moved.MOVED))\n')
  out = subprocess.run([sys.executable, '-c', code], cwd=_REPO,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]


def test_the_alias_finder_on_a_sample_move():
  code = (
      'import lingvo_ext\n'
      'from lingvo_ext import _moved\n'
      '_moved.MOVED["lingvo_ext.core.old_cost"] = "lingvo_ext.core.cost"\n'
      'from lingvo_ext.core import old_cost\n'
      'import lingvo_ext.core.cost as new\n'
      'assert old_cost is new\n'
      'try:\n'
      '  import lingvo_ext.core.never_was\n'
      'except ModuleNotFoundError:\n'
      '  print("ok")\n')
  out = subprocess.run([sys.executable, '-c', code], cwd=_REPO,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == 'ok', out.stderr[-2000:]
