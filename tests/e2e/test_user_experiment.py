"""A user's own experiment, and the overrides that the docs print.

The experiment tests run the trainer and cost_report binaries in
subprocesses, as the README's "Your own experiment" section tells a user to.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from lingvo import model_registry
import lingvo.compat as tf
import numpy as np
import pytest

from lingvo_ext import registry
from lingvo_ext.tasks import experiment_params
from tests.support import ROOT
from tests.support import zygote

TIMEOUT = 300

_EXPERIMENT = '''
from lingvo import model_registry
from params import lm


@model_registry.RegisterSingleTaskModel
class MyLm(lm.TransformerLmTiny):
  """A one-layer Tiny LM."""
  NUM_LAYERS = 1
'''


# Appended to the experiment for the trainer's run: whether the garbage
# collector is on when the trainer imports it, and at the run's end.
_GC_PROBE = '''
import atexit, gc, os
_probe = os.environ.get('GC_PROBE_FILE')
if _probe:
  with open(_probe, 'a') as _f:
    _f.write(f'import {gc.isenabled()}\\n')
  atexit.register(
      lambda: open(_probe, 'a').write(f'exit {gc.isenabled()}\\n'))
'''


def _Run(args, pythonpath=None, cwd=ROOT, fresh=False, **extra_env):
  env = dict(os.environ, **extra_env)
  if pythonpath:
    env['PYTHONPATH'] = pythonpath
  # The fork server has imported the repository's lingvo_ext already.
  run = subprocess.run if fresh else zygote.run
  proc = run([sys.executable, '-m', *args], cwd=cwd, env=env,
             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
             text=True, timeout=TIMEOUT, check=False)
  return proc.returncode, proc.stdout


@pytest.mark.e2e
def testOwnExperimentOnPythonpathTrainsAndIsCostReported(tmp_path):
  exp_dir = tmp_path / 'exp'
  exp_dir.mkdir()
  (exp_dir / 'myexp.py').write_text(_EXPERIMENT + _GC_PROBE)
  logdir = str(tmp_path / 'logdir')
  probe = tmp_path / 'gc.txt'
  rc, out = _Run(['lingvo_ext.trainer', '--model=myexp.MyLm',
                  f'--logdir={logdir}', '--max_steps=3'], str(exp_dir),
                 GC_PROBE_FILE=str(probe))
  assert rc == 0, out[-3000:]
  assert tf.train.latest_checkpoint(os.path.join(logdir, 'train')).endswith(
      'ckpt-00000003')
  # The trainer turns the collector off for its own imports only: it is on
  # by the time it looks the experiment up (and plans, builds, trains).
  assert probe.read_text() == 'import True\nexit True\n'
  rc, out = _Run(['lingvo_ext.tools.cost_report', '--model=myexp.MyLm'],
                 str(exp_dir))
  assert rc == 0, out[-3000:]
  assert 'model: myexp.MyLm' in out and 'total FLOPs' in out
  rc, out = _Run(['lingvo_ext.tools.list_models', 'myexp'], str(exp_dir))
  assert rc == 0 and 'myexp.MyLm\n' in out, out
  # A typo in the class is unknown, with the close names, in both binaries.
  for args in (['lingvo_ext.trainer', f'--logdir={logdir}'],
               ['lingvo_ext.tools.cost_report']):
    rc, out = _Run(args + ['--model=myexp.MyLM'], str(exp_dir))
    assert rc == 2, out
    assert "Unknown model 'myexp.MyLM'" in out and '  myexp.MyLm\n' in out
    assert 'Traceback' not in out


@pytest.mark.e2e
def testNewFileInExperimentsIsRegisteredWithoutOtherEdits(tmp_path):
  # A copy of the repository's params/ package, with one new file in it and
  # nothing else changed, found before the repository's (python -m puts the
  # working directory first on sys.path; a fresh interpreter, not the fork
  # server's).
  shutil.copytree(os.path.join(ROOT, 'params'), str(tmp_path / 'params'),
                  ignore=shutil.ignore_patterns('__pycache__'))
  (tmp_path / 'params' / 'mine.py').write_text(_EXPERIMENT)
  copy = dict(pythonpath=ROOT, cwd=str(tmp_path), fresh=True)
  rc, out = _Run(['lingvo_ext.tools.list_models'], **copy)
  assert rc == 0, out
  assert 'mine.MyLm\n' in out and 'lm.TransformerLmTiny\n' in out
  rc, out = _Run(['lingvo_ext.tools.cost_report', '--model=mine.MyLm'], **copy)
  assert rc == 0, out[-3000:]
  assert 'model: mine.MyLm' in out


def testTrainerAndListModelsSeeOneRegistry():
  from lingvo_ext.tools import list_models  # pylint: disable=g-import-not-at-top
  names = list_models.RegisteredModels()
  assert names == registry.RegisteredModels()
  for name in names:
    assert registry.CheckModel(name) is None
  assert 'Unknown model' in registry.CheckModel('lm.Nope')


# --model_params_override values printed in the docs, docstrings and
# messages: each must set what it names on a registered experiment.
_DOC_FILES = ['README.md', 'docs/*.md', 'lingvo_ext/**/*.py', 'params/*.py',
              'scripts/*.sh']
_OVERRIDE_RE = re.compile(r"--model_params_override=\\?'([^'{}\\]*)\\?'")


def _DocumentedOverrides():
  found = []
  for pattern in _DOC_FILES:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern),
                                 recursive=True)):
      if path.endswith(('coming-from-lingvo.md', 'machine-translation.md')):
        # A Lingvo experiment's: tests/tasks/test_lingvo_models.py, and the
        # MT page's runnable examples on the NMT fixture.
        continue
      with open(path, encoding='utf-8') as f:
        text = f.read()
      for m in _OVERRIDE_RE.finditer(text):
        if m.group(1).startswith('...'):
          continue  # A template of troubleshooting's list of error lines.
        if ':' in m.group(1):  # Else an f-string cut at a line end: its
          # message is tested by testShapeMismatchMessageSuggests...
          found.append((os.path.relpath(path, ROOT), m.group(1)))
  return found


def _Assignments(text):
  """[(key, value text)] of an override; docstrings may wrap it."""
  out = []
  for item in re.split(r'[;\n]', text):
    item = item.strip()
    if item:
      key, value = item.split(':', 1)
      out.append((key.strip(), value.strip()))
  return out


def _ParamsWithOverride(model, text):
  return experiment_params.GetParams(model, 'Train', text)


def _CheckOverride(text):
  """Applies `text` to the LM or the image experiment; checks each value."""
  keys = [k for k, _ in _Assignments(text)]
  image = any('npz' in k or 'data_shape' in k or 'num_classes' in k
              for k in keys)
  model = 'image.ConvClassifierTiny' if image else 'lm.TransformerLmTiny'
  cfg = _ParamsWithOverride(model, text)
  for key, value in _Assignments(text):
    if key.startswith('task.input.'):  # The task's input is cfg.input.
      key = key[len('task.'):]
    got = cfg.Get(key)
    if isinstance(got, tuple):
      got = str(got)
    if re.fullmatch(r'"[^"]*"', value):  # A quoted string param.
      value = value[1:-1]
    if isinstance(got, float):
      assert got == float(value), (text, key, got)
    else:
      assert str(got) == value, (text, key, got)


def testDocumentedOverridesSetWhatTheyName():
  found = _DocumentedOverrides()
  where = {path for path, _ in found}
  # The LM's and the image experiments' docstrings show one each.
  assert {'params/lm.py',
          'params/image.py'} <= where, found
  for _, text in found:
    _CheckOverride(text)


@pytest.mark.parametrize('text', [
    'task.input.text_file:/data/corpus.txt',
    'input.text_file:/data/corpus.txt',
    'task.input.npz_file:/data/images.npz',
    'task.train.learning_rate:0.01',
])
def testTaskInputOverridesWork(text):
  _CheckOverride(text)


def testShapeMismatchMessageSuggestsAWorkingOverride(tmp_path):
  npz = str(tmp_path / 'images.npz')
  rng = np.random.default_rng(0)
  np.savez(npz, images=rng.random([20, 6, 5, 1], np.float32),
           labels=np.arange(20) % 3)
  cfg = _ParamsWithOverride('image.ConvClassifierTiny',
                            f'input.npz_file:{npz}')
  with pytest.raises(ValueError) as e:
    cfg.input.Instantiate().Examples()
  overrides = _OVERRIDE_RE.findall(str(e.value))
  assert overrides and 'task.data_shape' not in str(e.value), str(e.value)
  cfg = _ParamsWithOverride('image.ConvClassifierTiny',
                            f'input.npz_file:{npz}; {overrides[0]}')
  assert tuple(cfg.input.data_shape) == (6, 5, 1)
  assert len(cfg.input.Instantiate().Examples().label) > 0
  # The data_shape fixed, the message for too few classes is next.
  cfg.input.num_classes = 2
  with pytest.raises(ValueError) as e:
    cfg.input.Instantiate().Examples()
  overrides = _OVERRIDE_RE.findall(str(e.value))
  assert overrides, str(e.value)
  fixed = _ParamsWithOverride(
      'image.ConvClassifierTiny',
      f'input.npz_file:{npz}; input.data_shape:(6, 5, 1); {overrides[0]}')
  assert fixed.input.num_classes == 3 and fixed.task.num_classes == 3
  assert len(fixed.input.Instantiate().Examples().label) > 0
