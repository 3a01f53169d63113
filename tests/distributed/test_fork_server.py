"""fork_server and fork_serving: runs forked as `python -m` runs them."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from lingvo_ext.distributed import fork_server
from lingvo_ext.distributed import fork_serving
from tests.support import ROOT

PROBE = [sys.executable, '-m', 'tests.support.fork_probe']


def _Lines(path):
  with open(path) as f:
    return f.read().splitlines()


def _Gone(pid, timeout_s=10):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.05)
  return False


@pytest.mark.e2e
def testForkedRunsEndAsAFreshInterpretersAndDieWithTheServer(
    tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  server = fork_server.ForkServer('tests.support.fork_probe',
                                  str(tmp_path / 'server.stderr'))
  assert server.Start(120) is None
  started = []
  try:
    env = dict(os.environ, PROBE='x', TF_CONFIG='{"task": {}}')
    # A fresh interpreter and a forked run see the same, end the same way.
    for i, what in enumerate(['3', 'signal', 'raise']):
      fresh_log, forked_log = tmp_path / f'fresh{i}', tmp_path / f'forked{i}'
      with open(fresh_log, 'wb') as log:
        fresh = subprocess.run(PROBE + [what, 'a b'], stdout=log,
                               stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=env, timeout=120,
                               start_new_session=True)
      forked = server.Spawn(PROBE + [what, 'a b'], env, str(forked_log))
      assert forked is not None
      started.append(forked.pid)
      assert forked.wait(60) == fresh.returncode
      assert forked.poll() == forked.returncode
      a, b = _Lines(fresh_log), _Lines(forked_log)
      assert json.loads(a[0])['numpy'] != json.loads(b[0])['numpy']
      a[0], b[0] = (json.loads(a[0]), json.loads(b[0]))
      a[0].pop('numpy')
      b[0].pop('numpy')
      assert a[0] == b[0] == dict(
          argv=[what, 'a b'], cwd=ROOT, path0=ROOT, probe='x',
          tf_config='{"task": {}}', stdin='', pgid_is_pid=True)
      # The interpreter's shutdown ran: the finalizer's line (and after an
      # uncaught exception, its traceback) is in the log.
      assert ('finalized' in a) == ('finalized' in b), (a, b)
      assert ('ValueError: probe raised' in a) == (
          'ValueError: probe raised' in b) == (what == 'raise')
    assert [fork_serving.ReturnCode(s) for s in (3 << 8, signal.SIGTERM)] == [
        3, -signal.SIGTERM]
    # A variable read at import that differs from the server's: not forked.
    assert server.Spawn(PROBE + ['0'], dict(
        env, TF_ENABLE_ONEDNN_OPTS='2'), str(tmp_path / 'other')) is None
    assert server.Spawn([sys.executable, '-m', 'other'], env,
                        str(tmp_path / 'other')) is None
    # A sleeping run dies with the server, and is reported killed.
    sleeper = server.Spawn(PROBE + ['sleep'], env, str(tmp_path / 'sleep'))
    started.append(sleeper.pid)
    with pytest.raises(subprocess.TimeoutExpired):
      sleeper.wait(0.5)
    os.kill(server._proc.pid, signal.SIGKILL)  # pylint: disable=protected-access
    assert sleeper.wait(30) == -signal.SIGKILL
    assert _Gone(sleeper.pid)
    assert server.Spawn(PROBE + ['0'], env, str(tmp_path / 'late')) is None
  finally:
    for pid in started:
      try:
        os.killpg(pid, signal.SIGKILL)
      except OSError:
        pass
    server.Close()


@pytest.mark.e2e
def testClosingTheServerKillsItsRuns(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  server = fork_server.ForkServer('tests.support.fork_probe',
                                  str(tmp_path / 'server.stderr'))
  assert server.Start(120) is None
  sleeper = None
  try:
    sleeper = server.Spawn(PROBE + ['sleep'], dict(os.environ),
                           str(tmp_path / 'sleep'))
    server.Close()
    assert _Gone(sleeper.pid)
  finally:
    if sleeper:
      try:
        os.killpg(sleeper.pid, signal.SIGKILL)
      except OSError:
        pass
    server.Close()


class _FakeServerProc:
  """A server's side of the protocol, played by the test: Say(msg) writes a
  line on its stdout, End() closes it."""

  def __init__(self):
    self._lines = queue.Queue()
    self.stdin = self

  @property
  def stdout(self):
    return iter(self._lines.get, None)

  def Say(self, msg):
    self._lines.put(json.dumps(msg).encode() + b'\n')

  def End(self):
    self._lines.put(None)

  def write(self, data):
    del data

  def flush(self):
    pass


def testAReusedPidIsANewTaskNotTheOneThatExited():
  # The kernel reuses pids (pid_max is 32768 on many machines), and a long
  # test run forks thousands of tasks: the second task with pid 7 must not
  # take the first one's exit code.
  server = fork_server.ForkServer(['m'], os.devnull)
  fake = _FakeServerProc()
  server._env = dict(os.environ)  # pylint: disable=protected-access
  server._proc = fake  # pylint: disable=protected-access
  reader = threading.Thread(target=server._Read, daemon=True)  # pylint: disable=protected-access
  reader.start()
  argv = [sys.executable, '-m', 'm']
  fake.Say({'pid': 7})
  first = server.Spawn(argv, os.environ, os.devnull)
  fake.Say({'exited': 7, 'returncode': 0})
  assert first.wait(10) == 0
  fake.Say({'pid': 7})
  second = server.Spawn(argv, os.environ, os.devnull)
  assert (first.pid, second.pid) == (7, 7)
  assert second.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    second.wait(0.1)
  fake.Say({'exited': 7, 'returncode': 3})
  assert second.wait(10) == 3 and first.poll() == 0
  fake.Say({'pid': 7})
  third = server.Spawn(argv, os.environ, os.devnull)
  fake.End()  # The server died: so did its task.
  reader.join(10)
  assert third.wait(10) == -int(signal.SIGKILL)
