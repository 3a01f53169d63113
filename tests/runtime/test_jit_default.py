"""The trainer's XLA default for unset jit_compile (runtime/jit_default.py)."""

import json
import os
import subprocess
import sys

import pytest

from lingvo_ext.core import jit_choice
from lingvo_ext.runtime import jit_default
from lingvo_ext.tasks import experiment_params
from tests.support import ROOT
from tests.support import lingvo_lm_testlib
from tests.support import zygote


def _Params(model='lm.TransformerLmTiny', overrides='', engine='lingvo_ext'):
  return experiment_params.GetParams(model, 'Train', overrides, '', engine)


def test_a_pipelined_task_is_unset_until_the_trainer_chooses():
  cfg = _Params()
  assert cfg.task.jit_compile is None
  assert [path for path, _ in jit_default.Unset(cfg)] == ['task.jit_compile']
  short = jit_default.Apply(cfg, 'auto', steps_to_go=999, min_steps=1000)
  assert (short.value, short.paths) == (False, ('task.jit_compile',))
  assert cfg.task.jit_compile is False
  assert 'too few' in short.Line()
  cfg = _Params()
  long = jit_default.Apply(cfg, 'auto', steps_to_go=1000, min_steps=1000)
  assert long.value == cfg.task.jit_compile == 'auto'
  assert '1000 steps to go >= --jit_auto_min_steps=1000' in long.Line()
  for flag, value in (('True', True), ('False', False)):
    cfg = _Params()
    assert jit_default.Apply(cfg, flag, 0, 1000).value is value
    assert cfg.task.jit_compile is value


@pytest.mark.parametrize('override', ['False', 'True', '"auto"'])
def test_a_value_the_user_set_is_kept(override):
  cfg = _Params(overrides=f'task.jit_compile:{override}')
  before = cfg.task.jit_compile
  assert before is not None
  assert jit_default.Apply(cfg, 'auto', 10**6, 0) is None
  assert cfg.task.jit_compile == before


def test_lingvos_gpipe_lm_gets_it_on_its_stack(tmp_path, monkeypatch):
  lingvo_lm_testlib.Write(str(tmp_path))
  monkeypatch.syspath_prepend(str(tmp_path))
  cfg = _Params(lingvo_lm_testlib.MODEL)
  decision = jit_default.Apply(cfg, 'auto', 10**6, 1000)
  assert decision.paths == ('task.lm.stack.jit_compile',)
  assert cfg.task.lm.stack.jit_compile == 'auto'
  # On Lingvo's own engine there is no such param: nothing to set.
  assert jit_default.Apply(_Params(lingvo_lm_testlib.MODEL, engine='lingvo'),
                           'auto', 10**6, 1000) is None


@pytest.mark.parametrize('flags,error', [
    (('--jit_compile=maybe',), '--jit_compile'),
    (('--jit_auto_min_steps=-1',), '--jit_auto_min_steps=-1 must be >= 0'),
])
def test_bad_flags_are_one_line(tmp_path, flags, error):
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer',
       '--model=lm.TransformerLmTiny', f'--logdir={tmp_path / "log"}',
       *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and error in lines[0], proc.stderr[-3000:]
  assert not os.path.exists(tmp_path / 'log')


def test_the_trainer_times_xla_only_for_a_run_long_enough(tmp_path):
  """For a short run (by default) or with --jit_compile=False it builds
  without XLA and times nothing; resumed with enough steps to go, it times
  both builds once and caches the choice."""
  cache = tmp_path / 'cache'
  env = dict(os.environ, XDG_CACHE_HOME=str(cache))
  logdir = tmp_path / 'log'
  cache_file = cache / 'lingvo_ext' / 'jit_compile.json'

  def Train(*flags):
    proc = zygote.run(
        [sys.executable, '-m', 'lingvo_ext.trainer',
         '--model=lm.TransformerLmTiny', f'--logdir={logdir}', *flags],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:]
    with open(logdir / 'log.controller+trainer_client.txt') as f:
      return f.read()

  log = Train('--max_steps=2')  # The flag's default: auto.
  assert ('jit_compile: False for task.jit_compile (2 steps to go < '
          '--jit_auto_min_steps=10000') in log
  log = Train('--max_steps=3', '--jit_compile=False')
  assert 'jit_compile: False for task.jit_compile (--jit_compile=False)' in log
  assert not cache_file.exists()
  log = Train('--max_steps=5', '--jit_auto_min_steps=2')
  assert ("jit_compile: 'auto' for task.jit_compile (2 steps to go >= "
          '--jit_auto_min_steps=2') in log
  entry, = json.loads(cache_file.read_text()).values()
  assert entry['jit_compile'] == (
      entry['ms_xla'] <= jit_choice.XLA_MARGIN * entry['ms_tf'])
  # Resolved before the build (runtime/jit_resolve.py), the bool in the
  # params; the pipeline's FProp has nothing left to choose.
  assert (f"jit_compile: {entry['jit_compile']} for task.jit_compile ('auto' "
          f"took {entry['jit_compile']}: ") in log and 'measured now' in log
  assert "pipeline: jit_compile='auto'" not in log
