"""The launcher's faults: a task that finds the disk full, the OOM killer, a
resumed run's old lines, a hung task (distributed/launch_lib.py).

The tests run the launcher in a process group of its own
(tests/support/proc_testlib.py), bound every wait and kill what they started
(SIGCONT first for a stopped one).
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from lingvo_ext.distributed import cluster_tasks
from lingvo_ext.distributed import launch_lib
from lingvo_ext.distributed import network
from tests.support import launcher_testlib
from tests.support import proc_testlib

TIMEOUT = 300


# --- The launcher: a full disk, the OOM killer, a resumed run's old lines -----


def _Launcher(tmp_path, programs, max_restarts=0):
  """A Launcher of 'controller' tasks running python `programs` (no
  servers); its output lines in a list."""
  out = launcher_testlib.Lines()
  port = network.FreePorts(1)[0]
  tasks = [cluster_tasks.Task(job, 0, f'127.0.0.1:{port}',
                              [sys.executable, '-c', code])
           for job, code in programs]
  launcher = launch_lib.Launcher(tasks, str(tmp_path), 30, max_restarts,
                                 out, fork_tasks=False, task_timeout_s=60)
  return launcher, out.lines


@pytest.mark.e2e
def testLauncherStopsTheClusterWhenATaskFindsTheDiskFull(tmp_path):
  launcher, lines = _Launcher(tmp_path, [
      ('worker', 'import time; time.sleep(60)'),
      ('controller', 'import sys; print("error: controller: disk full on '
       '--logdir=/x (0 B free): ...", file=sys.stderr); sys.exit(74)')],
                              max_restarts=3)
  assert launcher_testlib.Run(launcher) == 74
  text = '\n'.join(lines)
  assert '[controller] error: controller: disk full on --logdir=/x' in text
  assert re.search(r'launch: controller task 0 \(\S+\) stopped: the disk is '
                   r'full \(exit 74; its error line above\): stopping the '
                   r'cluster', text), text
  assert 'restarting' not in text
  assert all(t.proc.poll() is not None for t in launcher.tasks)


# A task of the launcher whose log (its stdout and stderr) cannot be written:
# /dev/full fails every write with ENOSPC, as a full disk does.
_LOG_FULL = ('import os, sys; from lingvo_ext.distributed import task_output; '
             'task_output.RelayErrorLines(); '
             'full = os.open("/dev/full", os.O_WRONLY); '
             '[os.dup2(full, fd) for fd in (1, 2)]; ')
_ERROR = ('print("error: controller: disk full on --logdir=/x (0 B free): '
          '...", file=sys.stderr, flush=True); ')


@pytest.mark.e2e
@pytest.mark.parametrize('log_full', [True, False])
def testATasksErrorLineReachesTheConsoleOnceWhenItsLogCannotBeWritten(
    tmp_path, log_full):
  relay = _LOG_FULL if log_full else (
      'import sys; from lingvo_ext.distributed import task_output; '
      'task_output.RelayErrorLines(); ')
  launcher, lines = _Launcher(tmp_path, [
      ('worker', 'import time; time.sleep(60)'),
      ('controller', relay + _ERROR + 'sys.exit(74)')])
  assert launcher_testlib.Run(launcher) == 74
  shown = [l for l in lines if 'error: controller: disk full' in l]
  assert shown == ['[controller] error: controller: disk full on '
                   '--logdir=/x (0 B free): ...'], lines
  with open(launcher.tasks[1].log_path) as f:
    logged = [l for l in f if l.startswith('error:')]
  assert len(logged) == (0 if log_full else 1), logged
  assert any('(exit 74; its error line above)' in l for l in lines), lines


@pytest.mark.e2e
@pytest.mark.parametrize('rc', sorted(launch_lib.NOT_RESTARTED))
def testLauncherDoesNotRestartATaskThatWouldFailAgain(tmp_path, rc):
  launcher, lines = _Launcher(tmp_path, [
      ('worker', 'import time; time.sleep(60)'),
      ('controller', 'import sys; print("error: controller: it failed", '
       f'file=sys.stderr); sys.exit({rc})')], max_restarts=3)
  assert launcher_testlib.Run(launcher) == rc
  text = '\n'.join(lines)
  assert '[controller] error: controller: it failed' in text
  assert re.search(rf'launch: controller task 0 \(\S+\) failed: .* \(exit '
                   rf'{rc}; its error line above\): not restarting it', text), (
                       text)
  assert 'restarting it (restart' not in text
  assert all(t.proc.poll() is not None for t in launcher.tasks)


_KILLS_ITSELF = 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'


@pytest.mark.e2e
def testLauncherSaysOomKilledWithTheLastRssAndDoesNotRestart(tmp_path):
  launcher, lines = _Launcher(tmp_path, [
      ('controller', 'import time; x = bytearray(50 << 20); time.sleep(1); '
       + _KILLS_ITSELF)], max_restarts=3)
  count = iter(range(100))
  launcher.oom_kills = lambda cgroup: next(count)  # Risen at the death.
  assert launcher_testlib.Run(launcher) == 137
  text = '\n'.join(lines)
  m = re.search(r'launch: controller task 0 \(\S+\), pid \d+, was killed by '
                r"the kernel's OOM killer \(its last RSS ([\d.]+) MB.*\): not "
                r'restarting it', text)
  assert m, text
  assert float(m.group(1)) >= 50, text
  assert launcher.restarts == 0


@contextlib.contextmanager
def _MemoryCgroup(limit):
  """A memory cgroup limited to `limit` bytes, nested in this process's own
  (so its limits still hold), removed at the end; (None, why) where this
  machine does not let us make one."""
  from lingvo_ext.distributed import task_health  # pylint: disable=g-import-not-at-top
  parent = task_health.CgroupDir(os.getpid())
  if not parent:
    yield None, 'no memory cgroup found for this process'
    return
  path = os.path.join(parent, f'lingvo_ext_test_oom_{os.getpid()}')
  limit_file = ('memory.max' if os.path.exists(
      os.path.join(parent, 'memory.events')) else 'memory.limit_in_bytes')
  try:
    os.mkdir(path)
  except OSError as e:
    yield None, f'cannot make a cgroup under {parent} ({e.strerror})'
    return
  try:
    try:
      with open(os.path.join(path, limit_file), 'w') as f:
        f.write(str(limit))
      for name in ('memory.swap.max', 'memory.swappiness'):  # No swapping.
        if os.path.exists(os.path.join(path, name)):
          with open(os.path.join(path, name), 'w') as f:
            f.write('0')
    except OSError as e:
      yield None, f'cannot limit the cgroup {path} ({e.strerror})'
    else:
      yield path, None
  finally:
    deadline = time.monotonic() + 30
    while os.path.exists(path):
      try:
        with open(os.path.join(path, 'cgroup.procs')) as f:
          for pid in f.read().split():  # Only this test's processes.
            try:
              os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
              pass
        os.rmdir(path)  # Once its processes are gone.
      except OSError:
        if time.monotonic() > deadline:
          raise
        time.sleep(0.2)


# The launcher in a process of its own, moved into the cgroup `argv[1]`
# before it starts its task: the task's memory counts there from its start.
_LAUNCHER_IN_CGROUP = '''
import os, sys
with open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w') as f:
  f.write(str(os.getpid()))
from lingvo_ext.distributed import cluster_tasks
from lingvo_ext.distributed import launch_lib
from lingvo_ext.distributed import network
grow = ('import time\\nx = []\\nwhile True:\\n'
        '  x.append(bytearray(8 << 20))\\n  time.sleep(0.02)\\n')
port = network.FreePorts(1)[0]
task = cluster_tasks.Task('controller', 0, f'127.0.0.1:{port}',
                          [sys.executable, '-c', grow])
launcher = launch_lib.Launcher([task], sys.argv[2], 30, 3, sys.stdout,
                               fork_tasks=False, task_timeout_s=60)
try:
  launcher.StartAll()
  rc = launcher.Watch(poll_s=0.05)
finally:
  launcher.StopAll(grace_s=5)
  launcher.Flush()
print(f'restarts {launcher.restarts}', flush=True)
sys.exit(rc)
'''


@pytest.mark.e2e
def testARealOomKillUnderTheLauncherIsNamedAndNotRestarted(tmp_path):
  """The kernel's OOM killer ends a task in a memory-limited cgroup."""
  limit = 160 << 20
  with _MemoryCgroup(limit) as (cgroup, why):
    if cgroup is None:
      pytest.skip(why)
    # A fresh interpreter (not one forked from the tests' zygote, whose
    # preloaded TensorFlow would count in the cgroup); whatever is left in
    # the cgroup is killed on the way out.
    run = subprocess.run([sys.executable, '-c', _LAUNCHER_IN_CGROUP, cgroup,
                          str(tmp_path)], cwd=proc_testlib.ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=TIMEOUT, check=False)
    rc, text = run.returncode, run.stdout
  assert rc == 137, text
  m = re.search(r'launch: controller task 0 \(\S+\), pid (\d+), was killed by '
                r"the kernel's OOM killer \(its last RSS ([\d.]+) MB, the "
                r"cgroup's limit 160.0 MB\): not restarting it", text)
  assert m, text
  assert 50 <= float(m.group(2)) <= 160, text
  assert not proc_testlib.Alive(int(m.group(1)))
  assert 'restarts 0' in text, text

@pytest.mark.e2e
def testATaskThatSigkillsItselfIsNotOom(tmp_path):
  launcher, lines = _Launcher(tmp_path, [('controller', _KILLS_ITSELF)])
  launcher.oom_kills = lambda cgroup: 3  # Not risen.
  assert launcher_testlib.Run(launcher) == 1
  text = '\n'.join(lines)
  assert 'OOM' not in text
  assert 'exited with signal SIGKILL' in text, text


@pytest.mark.e2e
def testAResumedLauncherShowsOnlyThisRunsTaskLines(tmp_path):
  for run in ('first', 'second'):
    launcher, lines = _Launcher(tmp_path, [
        ('controller', f'print("interrupted: the {run} run"); '
         f'print("step 1/2  loss 1.0 {run}")')])
    # The tail thread runs while the tasks start (the fork server takes
    # seconds to import TensorFlow).
    time.sleep(0.6)
    assert launcher_testlib.Run(launcher) == 0
  text = '\n'.join(lines)
  assert '[controller] interrupted: the second run' in text, text
  assert '[controller] step 1/2  loss 1.0 second' in text
  assert 'first' not in text, text
  # The log file keeps both runs.
  with open(os.path.join(tmp_path, 'launch', 'controller.0.log')) as f:
    log = f.read()
  assert 'the first run' in log and 'the second run' in log


# --- A hung task --------------------------------------------------------------


def _LaunchSteps(run, name):
  return [int(s) for s in re.findall(rf'^\[{name}\] step (\d+)/', run.Text(),
                                     re.M)]


@pytest.mark.e2e
def testAStoppedWorkerAndAStoppedPsAreKilledAndRestartedWithinTheBound(
    tmp_path):
  """SIGSTOP on the worker, then on the ps: the launcher names each within
  --task_timeout_secs, kills and restarts it, and training goes on."""
  logdir = str(tmp_path / 'log')
  bound = 6
  argv = [sys.executable, '-m', 'lingvo_ext.launch',
          '--model=lm.TransformerLmTinyGPipe', f'--logdir={logdir}',
          '--workers=1', '--ps=1', '--max_steps=1000000',
          f'--task_timeout_secs={bound}', '--worker_timeout_secs=120',
          # Restarts to spare: on a loaded machine the short bound can also
          # take busy tasks at their start for hung (all four, 8 s, once
          # in the suite on 2 cores), which would use up a budget of 4.
          '--max_restarts=12',
          '--model_params_override=train.save_interval_seconds:1']
  stopped = []
  with proc_testlib.Proc(argv) as run:
    try:
      run.WaitFor(r'launch: all 4 tasks are serving', TIMEOUT)
      run.WaitFor(r'^\[trainer_client\] step \d+/', TIMEOUT)
      for task in ('worker task 0', 'ps task 0'):
        n = len(_LaunchSteps(run, 'trainer_client'))
        pid = run.Pids()[task]
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        t0 = time.monotonic()
        run.WaitFor(rf'launch: {task} \(\S+\), pid {pid}, has not answered '
                    rf'for \d+ s \(--task_timeout_secs={bound}; it is stopped '
                    r'\(SIGSTOP\)\): killing it\.', bound + 60)
        # Named within the bound and the probes' own timeouts.
        assert time.monotonic() - t0 < bound + 30
        run.WaitFor(rf'launch: {task} \(\S+\), pid {pid}, was killed, hung '
                    r'\(signal SIGKILL\); restarting it', 30)
        run.WaitFor(rf'launch: started {task} \(\S+\) as pid (?!{pid}\b)\d+',
                    30)
        # Training goes on.
        deadline = time.monotonic() + TIMEOUT
        while len(_LaunchSteps(run, 'trainer_client')) <= n + 1:
          assert time.monotonic() < deadline, run.Text()[-5000:]
          assert run.proc.poll() is None, run.Text()[-5000:]
          time.sleep(0.2)
      run.proc.send_signal(signal.SIGTERM)
      assert run.Wait(120) == 0, run.Text()[-5000:]
    finally:
      for pid in stopped:
        try:
          os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
          pass
    pids = list(run.Pids().values())
  for pid in pids + stopped:
    assert not proc_testlib.Alive(pid), pid
  out = run.Text()
  assert out.rstrip().endswith('launch: stopped all 4 processes.'), out[-3000:]
