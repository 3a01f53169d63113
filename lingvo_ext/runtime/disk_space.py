"""A full disk: stop at once with one line, and warn before it fills.

When a job's write fails for want of space (ENOSPC, or EDQUOT: a quota),
`StopOnDiskFullMixin` (every runner has it) stops the process at once with
exit status 74 (EX_IOERR, sysexits.h) and one `error:` line naming the
logdir, the free space, the checkpoint that failed and the newest complete
one the same command resumes from; the failed save's partial `*_temp` files
are removed first. Lingvo's runner would log a traceback, go on for 10 s (a
trainer beside it stepping on, its steps never saved) and exit 1.

`HeadroomWarning` is the line a controller prints when the free space is
below what the next checkpoint needs (docs/faults.md).
"""

import errno
import glob
import os
import re
import shutil
import sys
from typing import Optional

import lingvo.compat as tf

from lingvo_ext import checkpoints
from lingvo_ext._internal import process
from lingvo_ext.runtime import progress

# sysexits.h's EX_IOERR: an error while doing I/O on a file.
EXIT_DISK_FULL = 74

_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_MESSAGES = tuple(os.strerror(e) for e in _ERRNOS)


def IsDiskFull(error: BaseException) -> bool:
  """Whether `error` (or an error it was raised from) is ENOSPC or EDQUOT.

  TensorFlow's file ops raise an OpError whose message carries strerror's
  text; Python's raise OSError with the errno.
  """
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _ERRNOS:
      return True
    if any(m in str(error) for m in _MESSAGES):
      return True
    error = error.__cause__ or error.__context__
  return False


def FormatBytes(n: float) -> str:
  """'0 B', '812 KB', '3.4 MB', '1.2 GB'."""
  for unit in ('B', 'KB', 'MB', 'GB'):
    if n < 1024 or unit == 'GB':
      return f'{n:.0f} {unit}' if unit in ('B', 'KB') else f'{n:.1f} {unit}'
    n /= 1024
  return f'{n:.1f} TB'


def FreeBytes(path: str) -> Optional[int]:
  """Free bytes (for this user) on `path`'s file system, or None."""
  if '://' in path:
    return None  # A remote file system.
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path or '.').free
  except OSError:
    return None


def RemovePartialFiles(train_dir: str) -> list:
  """Removes a failed save's `ckpt-N_temp` files and temporary state files.

  Lingvo's saver writes a checkpoint's shards under `ckpt-N_temp/` (TF's
  own, `ckpt-N_temp/part-*`) and renames them into place only when whole;
  the state file is written through `checkpoint.tmp*`.
  """
  removed = []
  patterns = ('*_temp', '*_temp_*', 'checkpoint.tmp*', '*.tempstate*')
  for pattern in patterns:
    for path in glob.glob(os.path.join(glob.escape(train_dir), pattern)):
      try:
        if os.path.isdir(path):
          shutil.rmtree(path)
        else:
          os.remove(path)
        removed.append(path)
      except OSError:
        pass
  return removed


def NewestComplete(train_dir: str) -> Optional[str]:
  """The newest checkpoint of the state file that reads back whole."""
  try:
    paths = checkpoints.CheckpointPaths(train_dir)
  except Exception:  # pylint: disable=broad-except
    return None  # A state file that does not parse: the restart rebuilds it.
  for path in sorted(paths, key=checkpoints.CheckpointStep, reverse=True):
    if checkpoints.CheckpointProblem(path) is None:
      return path
  return None


def _FailedCheckpoint(message: str) -> Optional[str]:
  """The checkpoint prefix a save's error names (`.../ckpt-00000300`)."""
  m = re.search(r'(\S*ckpt-\d+)(?:_temp|\.)', message)
  return m.group(1) if m else None


def _FailedFile(message: str) -> Optional[str]:
  m = re.search(r"(/[^\s'\"]+?)(?:[:;,]|'|\"|\s|$)", message)
  return m.group(1) if m else None


# A file written whole or not at all goes through `<name>.tmp<pid>` first
# (local_evaler, tasks/decoding.py); the line names the file meant.
_TEMP_SUFFIX = re.compile(r'\.tmp\d+$')


def _Kind(message):
  return ('quota exceeded' if os.strerror(errno.EDQUOT) in message else
          'disk full')


def DiskFullLine(job: str, logdir: str, error: BaseException) -> str:
  """The one line (without 'error: ') a job prints when the disk is full."""
  message = str(getattr(error, 'message', error))
  train_dir = os.path.join(logdir, 'train')
  free = FreeBytes(logdir)
  free = 'unknown space' if free is None else FormatBytes(free)
  failed = _FailedCheckpoint(message)
  if failed:
    what = f'checkpoint {os.path.basename(failed)} was not saved'
  else:
    path = _FailedFile(message)
    what = (f'could not write {_TEMP_SUFFIX.sub("", path)}' if path else
            'a write failed')
  newest = NewestComplete(train_dir)
  if not job.startswith(('controller', 'trainer', 'chief', 'worker', 'ps')):
    return (f'{job}: {_Kind(message)} on --logdir={logdir} ({free} free): '
            f'{what}. Free space and run the same command.')
  if newest:
    resume = (f'the newest complete checkpoint is {newest}, which the same '
              'command resumes from')
  else:
    resume = 'no complete checkpoint yet: the same command starts afresh'
  return (f'{job}: {_Kind(message)} on --logdir={logdir} ({free} free): '
          f'{what}; {resume}. Free space (or lower train.save_max_to_keep) '
          'and run the same command.')


def StopOnDiskFull(job: str, logdir: str, error: BaseException) -> None:
  """Removes partial files, prints the line and exits 74 at once."""
  train_dir = os.path.join(logdir, 'train')
  if os.path.isdir(train_dir):
    RemovePartialFiles(train_dir)
  partial = _FailedFile(str(getattr(error, 'message', error))) or ''
  if partial.endswith(f'.tmp{os.getpid()}') and os.path.isfile(partial):
    try:
      os.remove(partial)  # This process's half-written output.
    except OSError:
      pass
  line = DiskFullLine(job, logdir, error)
  try:
    progress.LogToFileOnly(line)  # Printed once on stderr, below.
    tf.logging.flush()
  except Exception:  # pylint: disable=broad-except
    pass  # The log file is on the full disk too.
  try:
    sys.stdout.flush()
  except OSError:
    pass
  print(f'error: {line}', file=sys.stderr, flush=True)
  process.ExitNow(EXIT_DISK_FULL)


class StopOnDiskFullMixin:
  """Lingvo's runners: a loop whose write finds the disk full stops the
  process at once (StopOnDiskFull), before Lingvo's error handling.

  The runner has `self._options` (trainer_flags.Options), set before this
  class's __init__: Lingvo's runners write there already (an evaler's
  params.txt), and a full disk stops them the same way.
  """

  def __init__(self, *args, **kwargs):
    try:
      super().__init__(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      options = getattr(self, '_options', None)
      if IsDiskFull(e) and options is not None and options.logdir:
        job = getattr(self, '_job_name', None) or ','.join(options.jobs)
        StopOnDiskFull(job, options.logdir, e)
      raise

  def _RunLoop(self, job_name, loop_func, loop_args=(), cleanup_func=None):

    def Loop(*args):
      try:
        return loop_func(*args)
      except Exception as e:  # pylint: disable=broad-except
        if IsDiskFull(e) and self._options.logdir:
          StopOnDiskFull(job_name, self._options.logdir, e)
        raise

    return super()._RunLoop(job_name, Loop, loop_args, cleanup_func)


# --- Headroom ----------------------------------------------------------------


def CheckpointBytes(path: str) -> int:
  """The bytes of the checkpoint at prefix `path` (its .index and .data)."""
  return sum(os.path.getsize(f) for f in glob.glob(glob.escape(path) + '.*')
             if os.path.isfile(f))


def HeadroomWarning(train_dir: str, keep: int,
                    free: Optional[int] = None) -> Optional[str]:
  """A warning line if the free space is below the next checkpoint's size.

  The size is the newest checkpoint's (known after the first save); None
  before that, or when there is room.
  """
  latest = checkpoints.LatestCheckpoint(train_dir)
  if not latest:
    return None
  need = CheckpointBytes(latest)
  free = FreeBytes(train_dir) if free is None else free
  if free is None or not need or free >= need:
    return None
  return (f'warning: {FormatBytes(free)} free on {train_dir}, below the '
          f'{FormatBytes(need)} the next checkpoint needs; the save will '
          'fail (exit 74): free space, or lower train.save_max_to_keep '
          f'(now {keep}).')
