"""tests/zygote.py: trainer runs forked from a pre-imported server."""

import fcntl
import os
import subprocess
import sys
import time

import pytest

from lingvo_ext import trainer

from tests import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = [sys.executable, '-m', 'lingvo_ext.trainer']


def testOnlyRunsWithTheServersImportTimeEnvironmentAreForked():
  env = dict(os.environ)
  assert zygote._Usable(TRAINER + ['--model=x'], env)
  # PYTHONPATH and variables read after the import may differ.
  assert zygote._Usable(TRAINER, dict(env, PYTHONPATH='/x', HOME='/y'))
  onednn = '0' if env.get('TF_ENABLE_ONEDNN_OPTS') == '1' else '1'
  assert not zygote._Usable(TRAINER, dict(env, TF_ENABLE_ONEDNN_OPTS=onednn))
  assert not zygote._Usable(TRAINER, dict(env, OMP_NUM_THREADS='7'))
  # A module the server does not serve.
  assert not zygote._Usable([sys.executable, '-m', 'lingvo_ext.tools.fix_x_ops'],
                            env)
  assert not zygote._Usable([sys.executable, '-c', 'pass'], env)


@pytest.mark.e2e
def testForkedRunEqualsAFreshInterpreterAndATimeoutKillsIt(tmp_path):
  # A bad flag: exit 2 with the same stdout and error line either way.
  cmd = TRAINER + ['--model=lm.TransformerLmTiny', '--max_step=3',
                   f'--logdir={tmp_path / "never"}']
  forks = zygote.forks
  forked = zygote.run(cmd, cwd=ROOT, capture_output=True, text=True,
                      timeout=120)
  # Forked, so the server was single-threaded after importing TensorFlow.
  assert zygote.forks == forks + 1
  fresh = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
  assert forked.returncode == fresh.returncode == 2
  assert forked.stdout == fresh.stdout
  error = [l for l in fresh.stderr.splitlines() if l.startswith('error:')]
  assert error and error == [
      l for l in forked.stderr.splitlines() if l.startswith('error:')]
  # A run past its timeout: its process group killed, TimeoutExpired raised.
  logdir = str(tmp_path / 'long')
  start = time.monotonic()
  with pytest.raises(subprocess.TimeoutExpired):
    zygote.run(TRAINER + ['--model=lm.TransformerLmTiny',
                          '--max_steps=1000000', f'--logdir={logdir}'],
               cwd=ROOT, capture_output=True, text=True, timeout=5)
  assert time.monotonic() - start < 60
  assert zygote.forks == forks + 2
  # It had taken the logdir's trainer lock, which is free again: it is gone.
  with open(os.path.join(logdir, trainer.LOCK_FILE)) as f:
    assert 'PID' in f.read()
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
