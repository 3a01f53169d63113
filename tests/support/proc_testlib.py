"""A test's commands in process groups of their own, output read by a thread.

Proc starts a command (the trainer, the launcher) in its own session,
collects its stdout and stderr lines, waits for a line of its output (never
a fixed sleep), bounds every wait, and as a context manager kills what it
started when the block ends, the test passed or not: its group and the
groups of the tasks a launcher says it started (each has its own).
"""

import os
import re
import signal
import subprocess
import threading
import time

from tests.support import ROOT
from tests.support import zygote

TIMEOUT = 300
# `python -c PRIVATE_TRAINER FLAGS...` is `python -m lingvo_ext.trainer
# FLAGS...` in a private network namespace (only 127.0.0.1): the trainer runs
# in the same process (tests/support/zygote.py forks it, TensorFlow imported).
PRIVATE_TRAINER = (
    'import runpy, sys; from lingvo_ext.distributed import network; '
    'network.EnterPrivateNetwork(); sys.argv[0] = "-m"; '
    'runpy.run_module("lingvo_ext.trainer", run_name="__main__", '
    'alter_sys=True)')
_STARTED = re.compile(r'launch: started (\w+ task \d+) \(\S+\) as pid (\d+)')


class _Forked:
  """A run forked from this process's zygote server
  (tests/support/zygote.py), its stdout and stderr into a pipe: the part of
  subprocess.Popen Proc uses."""

  def __init__(self, run, stdout):
    self._run, self.stdout, self.pid = run, stdout, run.pid

  def poll(self):  # pylint: disable=invalid-name
    return self._run.poll()

  def wait(self, timeout=None):  # pylint: disable=invalid-name
    return self._run.wait(timeout)

  def send_signal(self, sig):  # pylint: disable=invalid-name
    if self.poll() is None:
      os.kill(self.pid, sig)

  def kill(self):  # pylint: disable=invalid-name
    self.send_signal(signal.SIGKILL)


def Start(argv, out_path, err_path=None):
  """`argv` from the repository in a session of its own, its stdout appended
  to the file out_path and its stderr to err_path (default: out_path):
  forked (zygote) where it can be, else a fresh interpreter; a Popen-like
  handle (pid, poll, wait, send_signal, kill)."""
  err_path = err_path or out_path
  for path in (out_path, err_path):  # There at once, as with Popen.
    open(path, 'a').close()  # pylint: disable=consider-using-with
  env = dict(os.environ)
  if zygote.Usable(argv, env):
    run = zygote.Fork(argv, env, ROOT, out_path, err_path)
    if run is not None:
      return _Forked(run, None)
  with open(out_path, 'a') as out, open(err_path, 'a') as err:
    return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err,
                            start_new_session=True)


def _Fork(argv, env):
  """argv forked (zygote) with stdout and stderr into a pipe; None if the
  server cannot run it (then it is a fresh interpreter)."""
  if not zygote.Usable(argv, env):
    return None
  read, write = os.pipe()
  pipe = f'/proc/{os.getpid()}/fd/{write}'
  try:
    run = zygote.Fork(argv, env, ROOT, pipe, pipe)
    # The run opens the pipe by its path: the write end stays open here
    # until it has (or has exited), then only the run's copies hold it.
    deadline = time.monotonic() + 60
    mine = os.readlink(f'/proc/self/fd/{write}')
    while run is not None and run.poll() is None:
      try:
        if all(os.readlink(f'/proc/{run.pid}/fd/{fd}') == mine
               for fd in (1, 2)):
          break
      except OSError:  # Gone meanwhile: poll() says so next.
        pass
      assert time.monotonic() < deadline, 'the forked run never started'
      time.sleep(0.01)
  finally:
    os.close(write)
  if run is None:
    os.close(read)
    return None
  return _Forked(run, os.fdopen(read, 'r', errors='replace'))


class Proc:
  """`argv` from the repository, in its own process group; `python -m`
  runs of tests/support/zygote.py's MODULES are forked from its server."""

  def __init__(self, argv, env=None, read=True):
    """Starts it; read=False: its output stays in the pipe until
    StartReading (a reader that does not keep up)."""
    self.lines = []
    env = dict(os.environ, **(env or {}))
    self.proc = _Fork(argv, env) or subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors='replace', start_new_session=True, env=env)
    self._thread = threading.Thread(target=self._Read, daemon=True)
    if read:
      self.StartReading()

  def __enter__(self):
    return self

  def __exit__(self, *unused_exc):
    self.Kill()

  def StartReading(self):
    self._thread.start()

  def _Read(self):
    for line in self.proc.stdout:
      self.lines.append(line)

  def Text(self):
    return ''.join(self.lines)

  def WaitFor(self, pattern, timeout_s=TIMEOUT):
    """The first match of `pattern` (re.M) in the output, once it is there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      m = re.search(pattern, self.Text(), re.M)
      if m:
        return m
      if self.proc.poll() is not None and not self._thread.is_alive():
        break
      time.sleep(0.2)
    raise AssertionError(f'no {pattern!r} within {timeout_s} s:\n' +
                         self.Text()[-5000:])

  def Wait(self, timeout_s=TIMEOUT):
    """Its exit code, once it has exited and its output is read."""
    try:
      rc = self.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      raise AssertionError(f'still running after {timeout_s} s:\n' +
                           self.Text()[-5000:]) from None
    self._thread.join(10)
    return rc

  def Pids(self):
    """{'worker task 0': pid, ...}: the latest start of each launcher task."""
    return {m.group(1): int(m.group(2))
            for m in _STARTED.finditer(self.Text())}

  def Kill(self):
    """SIGKILL to its group and its tasks' groups."""
    for pid in [self.proc.pid, *self.Pids().values()]:
      try:
        os.killpg(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    try:
      self.proc.wait(10)
    except subprocess.TimeoutExpired:
      pass


def Alive(pid):
  """Whether pid runs (a zombie waiting for its reaper does not)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except FileNotFoundError:
    return False
