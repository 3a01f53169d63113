"""Faults of the machine: a full disk, a hung task, memory, broken input.

The end-to-end tests run the trainer or the launcher in process groups of
their own (tests/proc_testlib.py), bound every wait and kill what they
started (SIGCONT first for a stopped one); a filesystem a test mounts is
unmounted in a `finally`.
"""

import contextlib
import errno
import glob
import os
import re
import subprocess
import sys
import uuid

import lingvo.compat as tf
import pytest

from lingvo_ext import checkpoints
from lingvo_ext import disk_space
from tests import proc_testlib

TIMEOUT = 300
MODEL = '--model=lm.TransformerLmTiny'


def _ErrorLines(text):
  return [l for l in text.splitlines() if l.startswith('error:')]


# --- A full disk ----------------------------------------------------------------


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
  line = disk_space.DiskFullLine('evaler_dev', logdir,
                                 OSError(errno.ENOSPC, 'No space left on '
                                         'device'))
  assert 'the newest complete checkpoint is ' + os.path.join(
      train_dir, 'ckpt-100') in line, line
  assert 'a write failed' in line


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
    first = int(re.search(r'^step (\d+)/', text, re.M).group(1))
    assert step < first <= step + 2, text[-3000:]
    assert checkpoints.CheckpointStep(
        tf.train.latest_checkpoint(train_dir)) == step + 2
