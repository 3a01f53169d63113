"""Faults of the machine: a full disk, a hung task, memory, broken input.

The end-to-end tests run the trainer or the launcher in process groups of
their own (tests/support/proc_testlib.py), bound every wait and kill what they
started (SIGCONT first for a stopped one); a filesystem a test mounts is
unmounted in a `finally`.
"""

import contextlib
import errno
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import lingvo.compat as tf
from lingvo.tasks.lm import input_generator as lingvo_lm_input
import pytest

from lingvo_ext import checkpoints
from lingvo_ext.runtime import disk_space
from lingvo_ext.runtime import progress
from lingvo_ext.distributed import cluster_tasks
from lingvo_ext.distributed import launch_lib
from lingvo_ext.distributed import network
from lingvo_ext.tasks import input_files
from tests.support import lingvo_lm_testlib
from tests.support import proc_testlib

TIMEOUT = 300
MODEL = '--model=lm.TransformerLmTiny'


def _ErrorLines(text):
  return [l for l in text.splitlines() if l.startswith('error:')]


# --- A full disk --------------------------------------------------------------


def testIsDiskFullFindsEnospcAndEdquotThroughCauses():
  assert disk_space.IsDiskFull(OSError(errno.ENOSPC, 'x'))
  assert disk_space.IsDiskFull(OSError(errno.EDQUOT, 'x'))
  assert not disk_space.IsDiskFull(OSError(errno.EACCES, 'x'))
  op = tf.errors.ResourceExhaustedError(
      None, None, '/l/train/ckpt-00000300_temp/part-0.data; No space left '
      'on device')
  assert disk_space.IsDiskFull(op)
  try:
    try:
      raise op
    except tf.errors.OpError as e:
      raise RuntimeError('wrapped') from e
  except RuntimeError as e:
    assert disk_space.IsDiskFull(e)
  assert not disk_space.IsDiskFull(ValueError('out of memory'))


def _SmallCheckpoints(train_dir, steps):
  """Real checkpoints of one variable at `steps`, and the state file."""
  with tf.Graph().as_default():
    v = tf.Variable([1.0, 2.0, 3.0], name='v')
    saver = tf.train.Saver()
    with tf.Session() as sess:
      sess.run(v.initializer)
      for s in steps:
        saver.save(sess, os.path.join(train_dir, 'ckpt'), global_step=s)


def testDiskFullLineNamesLogdirSpaceFailedAndNewestCompleteAndCleansUp(
    tmp_path):
  logdir = str(tmp_path)
  train_dir = os.path.join(logdir, 'train')
  os.makedirs(train_dir)
  _SmallCheckpoints(train_dir, [100, 200])
  temp = os.path.join(train_dir, 'ckpt-00000300_temp')
  os.makedirs(temp)
  open(os.path.join(temp, 'part-00000-of-00001.data'), 'w').close()
  error = tf.errors.ResourceExhaustedError(
      None, None, f'{temp}/part-00000-of-00001.data-00000-of-00001.tempstate1;'
      ' No space left on device')
  line = disk_space.DiskFullLine('controller', logdir, error)
  assert line.startswith(f'controller: disk full on --logdir={logdir} (')
  assert ' free): checkpoint ckpt-00000300 was not saved;' in line
  newest = os.path.join(train_dir, 'ckpt-200')
  assert (f'the newest complete checkpoint is {newest}, which the same '
          'command resumes from') in line
  assert line.endswith('Free space (or lower train.save_max_to_keep) and run '
                       'the same command.')
  assert disk_space.RemovePartialFiles(train_dir) == [temp]
  assert not os.path.exists(temp)
  # The newest one damaged: the line names the one before.
  with open(newest + '.data-00000-of-00001', 'r+b') as f:
    f.truncate(4)
  error = OSError(errno.ENOSPC, 'No space left on device')
  line = disk_space.DiskFullLine('controller', logdir, error)
  assert 'the newest complete checkpoint is ' + os.path.join(
      train_dir, 'ckpt-100') in line, line
  assert ' free): a write failed; ' in line
  # An evaler or decoder: no checkpoint of its own.
  line = disk_space.DiskFullLine('evaler_dev', logdir, error)
  assert line.startswith(f'evaler_dev: disk full on --logdir={logdir} (')
  assert line.endswith(' free): a write failed. Free space and run the same '
                       'command.'), line


def testHeadroomWarningOnceTheFreeSpaceIsBelowACheckpoint(tmp_path):
  train_dir = str(tmp_path)
  assert disk_space.HeadroomWarning(train_dir, 100, free=0) is None  # None yet.
  _SmallCheckpoints(train_dir, [1])
  size = disk_space.CheckpointBytes(os.path.join(train_dir, 'ckpt-1'))
  assert size > 0
  assert disk_space.HeadroomWarning(train_dir, 100, free=size) is None
  line = disk_space.HeadroomWarning(train_dir, 7, free=size - 1)
  assert line.startswith(f'warning: {disk_space.FormatBytes(size - 1)} free '
                         f'on {train_dir}, below the '), line
  assert 'train.save_max_to_keep (now 7)' in line
  assert disk_space.FreeBytes('gs://bucket/log') is None  # Not the cwd's.


@contextlib.contextmanager
def _SmallFilesystem(path, size):
  """A tmpfs of `size` at `path` (root only), unmounted at the end; None if
  this machine cannot mount one."""
  os.makedirs(path, exist_ok=True)
  try:
    done = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}',
                           'tmpfs', path], capture_output=True, timeout=30,
                          check=False)
  except (OSError, subprocess.TimeoutExpired):
    done = None
  if done is None or done.returncode:
    yield None
    return
  try:
    yield path
  finally:
    subprocess.run(['umount', '-l', path], timeout=30, check=False)


# Fallback where no filesystem can be mounted: the saver's write fails with
# ENOSPC once the first checkpoints are written.
_INJECTED_ENOSPC = '''
import sys
from lingvo.core import saver
import lingvo.compat as tf
_save = saver.Saver.Save
_count = [0]
def _Save(self, sess, gsteps):
  _count[0] += 1
  if _count[0] > 2:
    raise tf.errors.ResourceExhaustedError(None, None, (
        self._logdir + '/ckpt-%08d_temp/part-00000-of-00001.data: No space '
        'left on device') % gsteps)
  return _save(self, sess, gsteps)
saver.Saver.Save = _Save
from lingvo_ext import trainer
sys.argv[0] = 'lingvo_ext.trainer'
sys.exit(trainer.Run())
'''


def _Fill(path, leave):
  """Fills `path`'s filesystem up to `leave` free bytes."""
  free = disk_space.FreeBytes(path)
  with open(os.path.join(path, 'filler'), 'wb') as f:
    f.write(b'\0' * max(0, free - leave))


@pytest.mark.e2e
def testDiskFullWhileSavingStopsAtOnceWith74AndTheSameCommandResumes(
    tmp_path):
  mount = str(tmp_path / 'small')
  with _SmallFilesystem(mount, '8m') as mounted:
    logdir = os.path.join(mount, 'log')
    flags = [MODEL, f'--logdir={logdir}', '--max_steps=1000000',
             '--model_params_override=train.save_interval_seconds:1']
    code = None if mounted else _INJECTED_ENOSPC
    argv = ([sys.executable, '-c', code] if code else
            [sys.executable, '-m', 'lingvo_ext.trainer'])
    train_dir = os.path.join(logdir, 'train')
    with proc_testlib.Proc(argv + flags) as run:
      run.WaitFor(r'^step \d+/', TIMEOUT)
      if mounted:
        # Less than a checkpoint (~320 KB) left: the next save fails.
        _Fill(mount, 150 << 10)
      rc = run.Wait(TIMEOUT)
    out = run.Text()
    assert rc == disk_space.EXIT_DISK_FULL, out[-3000:]
    errors = _ErrorLines(out)
    assert len(errors) == 1, out[-3000:]
    state = tf.train.get_checkpoint_state(train_dir)
    paths = [p if os.path.isabs(p) else os.path.join(train_dir, p)
             for p in state.all_model_checkpoint_paths]
    assert paths
    for p in paths:
      assert checkpoints.CheckpointProblem(p) is None, p
    newest = max(paths, key=checkpoints.CheckpointStep)
    assert errors[0].startswith(
        f'error: controller: disk full on --logdir={logdir} ('), errors[0]
    assert (f'the newest complete checkpoint is {newest}, which the same '
            'command resumes from') in errors[0], errors[0]
    assert 'run the same command.' in errors[0]
    assert not glob.glob(os.path.join(train_dir, '*_temp*')), os.listdir(
        train_dir)
    assert 'Traceback' not in out, out[-3000:]
    if mounted:
      # The headroom check saw it coming.
      assert 'below the' in out and 'train.save_max_to_keep' in out, out
      os.remove(os.path.join(mount, 'filler'))
    # The same command resumes from the newest complete checkpoint.
    step = checkpoints.CheckpointStep(newest)
    resume = [f if not f.startswith('--max_steps') else
              f'--max_steps={step + 2}' for f in flags]
    with proc_testlib.Proc([sys.executable, '-m', 'lingvo_ext.trainer'] +
                           resume) as again:
      rc = again.Wait(TIMEOUT)
    text = again.Text()
    assert rc == 0, text[-3000:]
    # Its first progress line is at the restored step or just after it.
    first = int(re.search(r'^step (\d+)/', text, re.M).group(1))
    assert step <= first <= step + 2, text[-3000:]
    assert checkpoints.CheckpointStep(
        tf.train.latest_checkpoint(train_dir)) == step + 2



# The evaler's and decoder's score file (their last output of a checkpoint)
# finds the disk full: half of it written, then ENOSPC as TensorFlow raises
# it.
_INJECTED_OUTPUT_ENOSPC = '''
import sys
import lingvo.compat as tf
from tensorflow.python.lib.io import file_io
_write = file_io.FileIO.write
def _Write(self, content):
  if '/score-' in self.name:
    _write(self, content[:len(content) // 2])
    self.flush()
    raise tf.errors.ResourceExhaustedError(
        None, None, self.name + '; No space left on device')
  return _write(self, content)
file_io.FileIO.write = _Write
from lingvo_ext import trainer
sys.argv[0] = 'lingvo_ext.trainer'
sys.exit(trainer.Run())
'''


def _Files(path):
  """{name: bytes} of the files in `path`."""
  out = {}
  for name in sorted(os.listdir(path)):
    with open(os.path.join(path, name), 'rb') as f:
      out[name] = f.read()
  return out


@pytest.mark.e2e
def testEvalerAndDecoderStopWith74WhenTheirOutputFindsTheDiskFull(tmp_path):
  logdir = str(tmp_path / 'log')
  train_dir = os.path.join(logdir, 'train')
  trainer = [sys.executable, '-m', 'lingvo_ext.trainer', MODEL,
             f'--logdir={logdir}']
  with proc_testlib.Proc(trainer + ['--max_steps=2']) as run:
    assert run.Wait(TIMEOUT) == 0, run.Text()[-3000:]
  saved = _Files(train_dir)

  def Stops(argv, job, written):
    with proc_testlib.Proc(argv + [f'--job={job}', '--eval_once']) as run:
      rc = run.Wait(TIMEOUT)
    out = run.Text()
    assert rc == disk_space.EXIT_DISK_FULL, out[-3000:]
    errors = _ErrorLines(out)
    assert len(errors) == 1 and re.fullmatch(
        re.escape(f'error: {job}: disk full on --logdir={logdir} (') +
        r'(\d+ B|\d+ KB|[\d.]+ [MG]B)' + re.escape(
            f' free): could not write {written}. Free space and run the '
            'same command.'), errors[0]), out[-3000:]
    assert 'Traceback' not in out, out[-3000:]
    # No half-written output left behind (a score file is written through
    # a temporary file, which is removed).
    assert not glob.glob(written + '.tmp*'), os.listdir(
        os.path.dirname(written))
    assert _Files(train_dir) == saved  # The checkpoints untouched.

  # A write in the loop: the score file of the checkpoint, in every job.
  injected = [sys.executable, '-c', _INJECTED_OUTPUT_ENOSPC] + trainer[3:]
  for job, out_dir in (('evaler_dev', 'eval_dev'),
                       ('decoder_dev', 'decoder_dev')):
    score = os.path.join(logdir, out_dir, 'score-00000002.txt')
    Stops(injected, job, score)
    assert not os.path.exists(score)
  # A disk full from the start: the evaler's first write (its params.txt)
  # on a filesystem mounted over its output directory.
  eval_dir = os.path.join(logdir, 'eval_dev')
  shutil.rmtree(eval_dir)
  with _SmallFilesystem(eval_dir, '64k') as mounted:
    if mounted:
      _Fill(mounted, 0)
      Stops(trainer, 'evaler_dev', os.path.join(eval_dir, 'params.txt'))
  # Space again: the same command evaluates the checkpoint.
  with proc_testlib.Proc(trainer + ['--job=evaler_dev', '--eval_once']) as run:
    assert run.Wait(TIMEOUT) == 0, run.Text()[-3000:]
  assert os.path.exists(os.path.join(eval_dir, 'score-00000002.txt'))
  assert _Files(train_dir) == saved

# --- The launcher: a full disk, the OOM killer, a resumed run's old lines -----


def _Launcher(tmp_path, programs, max_restarts=0):
  """A Launcher of 'controller' tasks running python `programs` (no
  servers); its output lines in a list."""
  lines = []

  class Out:

    def write(self, text):
      lines.extend(l for l in text.splitlines() if l)

    def flush(self):
      pass

  port = network.FreePorts(1)[0]
  tasks = [cluster_tasks.Task(job, 0, f'127.0.0.1:{port}',
                              [sys.executable, '-c', code])
           for job, code in programs]
  launcher = launch_lib.Launcher(tasks, str(tmp_path), 30, max_restarts,
                                 Out(), fork_tasks=False, task_timeout_s=60)
  return launcher, lines


def _RunLauncher(launcher):
  try:
    launcher.StartAll()
    return launcher.Watch(poll_s=0.05)
  finally:
    launcher.StopAll(grace_s=5)
    launcher.Flush()


@pytest.mark.e2e
def testLauncherStopsTheClusterWhenATaskFindsTheDiskFull(tmp_path):
  launcher, lines = _Launcher(tmp_path, [
      ('worker', 'import time; time.sleep(60)'),
      ('controller', 'import sys; print("error: controller: disk full on '
       '--logdir=/x (0 B free): ...", file=sys.stderr); sys.exit(74)')],
                              max_restarts=3)
  assert _RunLauncher(launcher) == 74
  text = '\n'.join(lines)
  assert '[controller] error: controller: disk full on --logdir=/x' in text
  assert re.search(r'launch: controller task 0 \(\S+\) stopped: the disk is '
                   r'full \(exit 74; its error line above\): stopping the '
                   r'cluster', text), text
  assert 'restarting' not in text
  assert all(t.proc.poll() is not None for t in launcher.tasks)


@pytest.mark.e2e
@pytest.mark.parametrize('rc', sorted(launch_lib.NOT_RESTARTED))
def testLauncherDoesNotRestartATaskThatWouldFailAgain(tmp_path, rc):
  launcher, lines = _Launcher(tmp_path, [
      ('worker', 'import time; time.sleep(60)'),
      ('controller', 'import sys; print("error: controller: it failed", '
       f'file=sys.stderr); sys.exit({rc})')], max_restarts=3)
  assert _RunLauncher(launcher) == rc
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
  assert _RunLauncher(launcher) == 137
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
  assert _RunLauncher(launcher) == 1
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
    assert _RunLauncher(launcher) == 0
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
          '--max_restarts=4',
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


# --- Input that breaks mid-run ------------------------------------------------


def _TextInput(pattern):
  p = lingvo_lm_input.LmInput.Params()
  p.file_pattern = pattern
  return p


def _Lines(path, n=200):
  with open(path, 'w') as f:
    for i in range(n):
      f.write(f'the cat sat on mat number {i}\n')


@pytest.mark.parametrize('change, expected', [
    ('delete', 'was deleted during the run'),
    ('empty', 'became empty during the run (was '),
    ('binary', 'changed during the run and now holds binary data'),
    ('latin1', 'changed during the run and now is not UTF-8 text'),
    ('shorter', None),
    ('longer', None),
])
def testFileWatchNamesADeletedEmptiedOrBinaryFile(tmp_path, change, expected):
  a, b = str(tmp_path / 'a.txt'), str(tmp_path / 'b.txt')
  _Lines(a)
  _Lines(b)
  watch = input_files.FileWatch(_TextInput(f'text:{tmp_path}/*.txt'))
  assert watch.files == [a, b]
  assert watch.Problem() is None
  if change == 'delete':
    os.remove(b)
  elif change == 'empty':
    open(b, 'w').close()
  elif change == 'binary':
    with open(b, 'wb') as f:
      f.write(bytes(range(256)) * 40)
  elif change == 'latin1':
    with open(b, 'wb') as f:
      f.write('caf\xe9 au lait\n'.encode('latin-1') * 100)
  elif change == 'shorter':
    _Lines(b, 10)
  else:
    _Lines(b, 400)
  problem = watch.Problem()
  if expected is None:
    assert problem is None, problem
    return
  assert problem.startswith(
      f"input.file_pattern='text:{tmp_path}/*.txt': {b} "), problem
  assert expected in problem, problem


def testFileWatchLeavesInputsWithoutLocalFilesAlone():
  assert input_files.StartWatch(None, stop=None) is None
  assert input_files.StartWatch(_TextInput('iota:'), stop=None) is None


@pytest.mark.e2e
def testLingvosLmInputFileDeletedMidRunIsOneLineNotAHang(tmp_path):
  # Lingvo's own GPipe LM on LmInput, as a user writes it (one module for
  # the tests that run it).
  folder = lingvo_lm_testlib.Write(tmp_path / 'exp')
  data = str(tmp_path / 'data.txt')
  _Lines(data)
  logdir = str(tmp_path / 'log')
  env = dict(LINGVO_GPIPE_LM_DATA=data, PYTHONPATH=folder + os.pathsep +
             os.environ.get('PYTHONPATH', ''))
  with proc_testlib.Proc([sys.executable, '-m', 'lingvo_ext.trainer',
                          f'--model={lingvo_lm_testlib.MODEL}',
                          f'--logdir={logdir}',
                          '--max_steps=1000000'], env=env) as run:
    run.WaitFor(r'^step \d+/', TIMEOUT)
    os.remove(data)
    # The watch looks every second.
    rc = run.Wait(60)
  out = run.Text()
  assert rc == 65, out[-3000:]
  errors = _ErrorLines(out)
  assert len(errors) == 1, out[-3000:]
  assert errors[0].startswith(
      f"error: input.file_pattern='text:{data}': {data} was deleted during "
      'the run: '), errors[0]
  assert 'Put the data back and run the same command' in errors[0]


@pytest.mark.e2e
def testLingvoExtInputChangedMidRunTrainsOnItsDataInMemory(tmp_path):
  data = str(tmp_path / 'data.txt')
  _Lines(data, 400)
  logdir = str(tmp_path / 'log')
  with proc_testlib.Proc([
      sys.executable, '-m', 'lingvo_ext.trainer', MODEL,
      f'--logdir={logdir}', '--max_steps=300',
      f'--model_params_override=input.text_file:"{data}"']) as run:
    run.WaitFor(r'^step \d+/', TIMEOUT)
    with open(data, 'wb') as f:
      f.write(bytes(range(256)) * 40)
    rc = run.Wait(TIMEOUT)
  out = run.Text()
  assert rc == 0, out[-3000:]
  assert not _ErrorLines(out), out[-3000:]
  assert checkpoints.CheckpointStep(tf.train.latest_checkpoint(
      os.path.join(logdir, 'train'))) == 300
  # The next start reads the file again: one line naming it.
  with proc_testlib.Proc([
      sys.executable, '-m', 'lingvo_ext.trainer', MODEL,
      f'--logdir={logdir}', '--max_steps=400',
      f'--model_params_override=input.text_file:"{data}"']) as run:
    rc = run.Wait(TIMEOUT)
  out = run.Text()
  assert rc == 2, out[-3000:]
  assert _ErrorLines(out) == [
      f"error: text_file='{data}' is not UTF-8 text (byte 0x80 at offset "
      "128); point text_file at a UTF-8 text file."], out[-3000:]


def testEveryRunnersLoopStopsWith74OnAFullDisk(tmp_path, monkeypatch):
  """The runners' mixin: a loop that raises ENOSPC exits 74 at once, before
  Lingvo's handling (its traceback, 10 s more, exit 1)."""
  exits = []
  monkeypatch.setattr(disk_space.process, 'ExitNow', exits.append)

  class Base:

    def _RunLoop(self, job_name, loop_func, loop_args=(), cleanup_func=None):
      try:
        loop_func(*loop_args)
      except Exception:  # pylint: disable=broad-except
        exits.append('lingvo')

  class Runner(disk_space.StopOnDiskFullMixin, Base):
    _options = types.SimpleNamespace(logdir=str(tmp_path))

  def Full():
    raise tf.errors.ResourceExhaustedError(
        None, None, f'{tmp_path}/eval_dev/events.out: No space left on device')

  Runner()._RunLoop('evaler_dev', Full)
  assert exits[0] == disk_space.EXIT_DISK_FULL, exits

  def Other():
    raise ValueError('not a disk')

  exits.clear()
  Runner()._RunLoop('evaler_dev', Other)
  assert exits == ['lingvo']


def testALogFileThatCannotBeWrittenSaysSoOnceAndKeepsQuiet(capsys):

  class Full:
    name = '/full/log.txt'

    def write(self, text):
      raise OSError(errno.ENOSPC, 'No space left on device')

    flush = lambda self: self.write('')

  log = progress._LogFile(Full())  # pylint: disable=protected-access
  for _ in range(3):
    log.write('I1128 a log line\n')
    log.flush()
  log.close()
  err = capsys.readouterr().err
  assert err == ('note: cannot write the log file /full/log.txt (No space '
                 'left on device); its lines are dropped from now on.\n'), err
