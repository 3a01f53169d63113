"""Importing lingvo_ext changes nothing in the process; the package's floors
and its rules (no tensorflow.python or patch outside _internal/)."""

import ast
import os
import re
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
  real['lingvo_ext/pipeline/records.py'].add('lingvo_ext/planner/plans.py')
  assert import_graph.Violations(real) == [(
      'lingvo_ext/pipeline/records.py', 'lingvo_ext/planner/plans.py')]
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


def test_import_changes_nothing_in_the_process():
  # A library user's process (no entry point): importing lingvo_ext and its
  # layers, pipeline and Lingvo faces adds no import hook, no placeholder
  # module, no environment variable, no logging filter; TensorFlow's
  # function namer and Lingvo's own gpipe module stay as they were.
  code = (
      'import logging, os, sys\n'
      'import lingvo.compat as tf\n'
      'from lingvo.core import gpipe as lingvo_gpipe\n'
      # What Lingvo's and setuptools' own imports change (an environment
      # variable, an import hook) is theirs: imported first.
      'import lingvo.core.program, pkg_resources\n'
      'from tensorflow.python.eager.polymorphic_function import '
      'concrete_function as cf\n'
      'def State():\n'
      '  return (list(sys.meta_path), dict(os.environ),\n'
      '          [list(logging.getLogger(n).filters) for n in '
      '("tensorflow", "absl", "")],\n'
      '          cf._inference_name, cf._forward_name, cf._backward_name,\n'
      '          sys.modules["lingvo.core.gpipe"])\n'
      'before = State()\n'
      'import lingvo_ext\n'
      'from lingvo_ext import layers, pipeline\n'
      'from lingvo_ext.core import gpipe, layers_with_gpipe\n'
      'from lingvo_ext.pipeline import schedules\n'
      'from lingvo_ext._internal import tf as internal_tf\n'
      'assert internal_tf.StableFunctionName("f") == "f"\n'
      'assert State() == before\n'
      'assert sys.modules["lingvo.core.gpipe"] is lingvo_gpipe\n'
      'assert not [m for m in sys.modules.values()\n'
      '            if type(m).__name__ == "Deferred"]\n'
      'print("ok")\n')
  out = subprocess.run([sys.executable, '-c', code], cwd=_REPO,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == 'ok', out.stderr[-2000:]


def _Sources():
  from tests import import_graph  # pylint: disable=g-import-not-at-top
  for f in import_graph.Files():
    yield f, ast.parse(open(os.path.join(_REPO, f)).read(), f)


def test_no_tensorflow_python_outside_internal():
  found = []
  for f, tree in _Sources():
    if f.startswith('lingvo_ext/_internal/'):
      continue
    for node in ast.walk(tree):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module]
      found += [f'{f}:{node.lineno}' for n in names
                if n == 'tensorflow.python' or
                n.startswith('tensorflow.python.')]
  assert not found


# Setting up the process is the entry point's (and the console filter's),
# not a library module's: the two programs' set-up files may.
_SETUP = ('lingvo_ext/_startup.py', 'lingvo_ext/entry_point.py')


def Patches(tree):
  """Lines of `tree` (a module's ast) that patch a module or an instance:
  an attribute assigned on a name the module imported, a method (FProp...)
  assigned on any object, setattr on an imported name, sys.modules or
  sys.meta_path changed."""
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      imported |= {(a.asname or a.name).split('.')[0] for a in node.names}
  out = []
  for node in ast.walk(tree):
    targets = []
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for t in targets:
      if isinstance(t, ast.Subscript):
        t = t.value
      if not isinstance(t, ast.Attribute):
        continue
      base = t.value
      method = t.attr.startswith('FProp') or t.attr in ('Reset', 'FPropMeta')
      if t.attr == 'excepthook':  # Python's own hook for a program to set.
        continue
      # A program's own process state (os.environ, sys.argv, sys.stderr) is
      # not a library patch; sys.modules and sys.meta_path are below.
      if method or (isinstance(base, ast.Name) and base.id in imported and
                    base.id not in ('os', 'sys')):
        out.append(node.lineno)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
        node.func.id == 'setattr' and node.args and
        isinstance(node.args[0], ast.Name) and node.args[0].id in imported):
      out.append(node.lineno)
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id == 'sys' and node.attr in ('modules', 'meta_path')
        and isinstance(getattr(node, 'ctx', None), ast.Load)):
      out.append(('sys', node.lineno))
  return out


def test_no_patch_outside_internal():
  found = {}
  for f, tree in _Sources():
    if f.startswith('lingvo_ext/_internal/') or f in _SETUP:
      continue
    # Reading sys.modules is not patching it: only its changes count.
    lines = [n for n in Patches(tree) if not isinstance(n, tuple)]
    source = open(os.path.join(_REPO, f)).read().split('\n')
    lines += [n for k, n in (x for x in Patches(tree) if isinstance(x, tuple))
              if re.search(r'sys\.(modules\[[^]]*\] *=|modules\.(pop|update|'
                           r'setdefault)|meta_path\.(insert|append|remove))',
                           source[n - 1])]
    # Lingvo's absl flags are set through their FLAGS object (its API).
    lines = [n for n in lines if 'FLAGS' not in source[n - 1]]
    if lines:
      found[f] = sorted(set(lines))
  assert not found


def test_the_patch_finder_sees_patches():
  tree = ast.parse(
      'import sys\nfrom lingvo.core import py_utils\n'
      'py_utils.X = 1\nlayer.FPropSequential = f\nsetattr(py_utils, "Y", 2)\n'
      'self.x = 3\nobj.attr = 4\n')
  assert Patches(tree) == [3, 4, 5]
