"""The runtime's faults: a full disk while saving, evaluating or logging
(runtime/disk_space.py, runtime/progress.py).

The end-to-end tests run the trainer in process groups of their own
(tests/support/proc_testlib.py), bound every wait and kill what they started;
a filesystem a test mounts is unmounted in a `finally`. The launcher's faults
are in tests/distributed/test_launcher_faults.py, broken input in
tests/tasks/test_input_faults.py, memory in tests/runtime/test_*memory*.py.
"""

import contextlib
import errno
import glob
import os
import re
import shutil
import subprocess
import sys
import types

import lingvo.compat as tf
import pytest

from lingvo_ext import checkpoints
from lingvo_ext.runtime import disk_space
from lingvo_ext.runtime import progress
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
  """Fills `path`'s filesystem up to about `leave` free bytes.

  The trainer saves meanwhile (every second): where its save takes the
  space first, the filler stops at the full disk and gives back what
  leaves `leave` bytes free.
  """
  fd = os.open(os.path.join(path, 'filler'),
               os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  try:
    while True:
      room = disk_space.FreeBytes(path) - leave
      if room <= 0:
        break
      try:
        os.write(fd, b'\0' * min(room, 1 << 16))
      except OSError as e:
        if e.errno != errno.ENOSPC:
          raise
        break
    lack = leave - disk_space.FreeBytes(path)
    if lack > 0:
      os.ftruncate(fd, max(0, os.fstat(fd).st_size - lack))
  finally:
    os.close(fd)


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
