"""tests/support/zygote.py: trainer runs forked from a pre-imported server."""

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from lingvo_ext import trainer
from tests.support import ROOT
from tests.support import zygote

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
  # `-c CODE` runs as tests.support.zygote_code.
  assert zygote._Usable([sys.executable, '-c', 'pass'], env)
  assert not zygote._Usable([sys.executable, '-E', '-c', 'pass'], env)


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
  with pytest.raises(subprocess.TimeoutExpired):
    zygote.run(TRAINER + ['--model=lm.TransformerLmTiny',
                          '--max_steps=1000000', f'--logdir={logdir}'],
               cwd=ROOT, capture_output=True, text=True, timeout=5)
  assert zygote.forks == forks + 2
  # It had taken the logdir's trainer lock, which is free again: it is gone.
  with open(os.path.join(logdir, trainer.LOCK_FILE)) as f:
    assert 'PID' in f.read()
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _LockFree(path):
  with open(path) as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return True
    except BlockingIOError:
      return False


@pytest.mark.e2e
def testBridgeForksAProgramsModuleRunsAndKillsThemWithIt(tmp_path):
  """As a docs example's `.venv/bin/python -m ...` (test_docs_examples)."""
  bridge = zygote.Bridge(str(tmp_path))
  try:
    shim = tmp_path / 'python'
    shim.write_text(bridge.Shim())
    shim.chmod(0o755)
    forks = zygote.forks
    # A bad flag: its error line and exit code, through bash's pipes.
    proc = subprocess.run(
        ['bash', '-c', f'{shim} -m lingvo_ext.trainer --max_step=3 2>&1 | '
         'grep "^error:"; exit ${PIPESTATUS[0]}'],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc
    assert proc.stdout.startswith('error: ') and 'max_step' in proc.stdout
    assert zygote.forks == forks + 1
    # `-c CODE` is forked, and runs as in a fresh interpreter: sys.argv,
    # sys.path[0], __main__, the garbage collector on (the server turns it
    # off while it imports), an exception's exit code and traceback.
    code = ('import gc, sys; print(sys.argv, repr(sys.path[0]), __name__, '
            'sys.modules["__main__"].__dict__ is globals(), gc.isenabled()); '
            'sys.stdout.flush(); 1 / int(sys.argv[1])')
    fresh = subprocess.run([sys.executable, '-c', code, '0'],
                           capture_output=True, text=True, timeout=300,
                           check=False)
    proc = subprocess.run([str(shim), '-c', code, '0'], capture_output=True,
                          text=True, timeout=300, check=False)
    assert zygote.forks == forks + 2
    assert fresh.stdout == "['-c', '0'] '' __main__ True True\n", fresh
    assert (proc.returncode, proc.stdout) == (1, fresh.stdout), proc
    assert proc.stderr.endswith('ZeroDivisionError: division by zero\n')
    assert proc.stderr == fresh.stderr
    # Another form (`-E -c`): a fresh interpreter, not forked.
    proc = subprocess.run([str(shim), '-E', '-c',
                           'import sys; print(sys.argv[1:])', 'a'],
                          capture_output=True, text=True, timeout=300,
                          check=False)
    assert (proc.returncode, proc.stdout) == (0, "['a']\n"), proc
    assert zygote.forks == forks + 2
    # The program killed mid-run: its forked run goes too (the trainer's
    # lock on its logdir is free again).
    logdir = tmp_path / 'long'
    lock = str(logdir / trainer.LOCK_FILE)
    program = subprocess.Popen(
        [str(shim), '-m', 'lingvo_ext.trainer', '--model=lm.TransformerLmTiny',
         '--max_steps=1000000', f'--logdir={logdir}'],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
      deadline = time.monotonic() + 300
      while not (os.path.exists(lock) and 'PID' in open(lock).read()):
        assert time.monotonic() < deadline and program.poll() is None
        time.sleep(0.2)
      assert zygote.forks == forks + 3
      os.killpg(program.pid, signal.SIGKILL)
      deadline = time.monotonic() + 120
      while not _LockFree(lock):
        assert time.monotonic() < deadline, 'the forked run outlived it'
        time.sleep(0.2)
    finally:
      try:
        os.killpg(program.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      program.wait(60)
  finally:
    bridge.Close()
