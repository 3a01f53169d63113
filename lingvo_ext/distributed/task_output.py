"""What the launcher prints of its tasks, from a writer thread of its own.

The tasks write their whole output to LOGDIR/launch/JOB.TASK.log; the
launcher shows the lines `SHOWN` matches (or every line with --stream_logs)
through `Output`, so a slow reader of its output never blocks a task.
A task's `error:` lines also come over a pipe of the launcher's
(`ErrorPipe`, which the task's `RelayErrorLines` writes to): they reach the
console when the log cannot be written (a full disk), and once.
"""

import collections
import os
import re
import sys
import tempfile
import threading
import time

# The FIFO a task started by the launcher writes its `error:` lines to.
ERROR_PIPE_ENV = 'LINGVO_EXT_ERROR_PIPE'

# Lines of a task's log shown without --stream_logs: the trainer's progress
# line and the tasks' own one-line messages (not Lingvo's and TensorFlow's
# INFO log records).
SHOWN = re.compile(
    r'^(step \d+/\d+ |error:|warning:|note:|interrupted|TF_CONFIG:|Slurm:|'
    r'plan check:|'
    r'(controller|trainer_client|trainer|worker|ps|evaler_\w+|decoder_\w+)'
    r'(,\w+)*( task \d+)?:)')


class Output:
  """Writes lines to `out` from a thread of its own.

  Put never blocks: when the reader is slow and --stream_logs lines pile up
  beyond max_lines, the newest task lines are dropped (and counted); the
  launcher's own lines are always kept.
  """

  def __init__(self, out, logdir: str, max_lines: int = 20000):
    self._out = out
    self._logdir = logdir
    self._max = max_lines
    self._lines = collections.deque()
    self._dropped = 0
    self._busy = False
    self._cv = threading.Condition()
    threading.Thread(target=self._Run, daemon=True, name='output').start()

  def Put(self, line: str, keep: bool = True) -> None:
    with self._cv:
      if not keep and len(self._lines) >= self._max:
        self._dropped += 1
        return
      self._lines.append(line if line.endswith('\n') else line + '\n')
      self._cv.notify_all()

  def _Run(self):
    while True:
      with self._cv:
        while not self._lines:
          self._busy = False
          self._cv.notify_all()
          self._cv.wait()
        self._busy = True
        line = self._lines.popleft()
        dropped, self._dropped = self._dropped, 0
      try:
        if dropped:
          self._out.write(f'launch: {dropped} log line(s) not shown (the '
                          'output is read slowly); every line is in '
                          f'{self._logdir}\n')
        self._out.write(line)
        self._out.flush()
      except (OSError, ValueError):
        pass  # A closed reader: the logs still have every line.

  def Flush(self, timeout_s: float = 5) -> None:
    """Waits (at most timeout_s) until every line is written."""
    deadline = time.monotonic() + timeout_s
    with self._cv:
      while self._lines or self._busy:
        left = deadline - time.monotonic()
        if left <= 0:
          return
        self._cv.wait(left)


class ErrorPipe:
  """The FIFO a task's `error:` lines come over (its RelayErrorLines).

  Each line is shown once, whether the pipe or the task's log brings it
  first (`FirstTime`).
  """

  def __init__(self, path: str):
    self.path = path
    os.mkfifo(path, 0o600)
    # Open while the launcher runs: a task's open never blocks, and a task
    # that exits leaves it readable for the next.
    self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    self._partial = b''
    self._seen = {'pipe': collections.Counter(), 'log': collections.Counter()}

  def Lines(self):
    """The complete lines written since the last call."""
    data = b''
    while self._fd is not None:
      try:
        chunk = os.read(self._fd, 1 << 16)
      except BlockingIOError:
        break
      if not chunk:
        break
      data += chunk
    lines = (self._partial + data).split(b'\n')
    self._partial = lines.pop()
    return [l.decode('utf-8', 'replace') for l in lines]

  def FirstTime(self, line: str, source: str) -> bool:
    """Whether `line` from `source` ('pipe' or 'log') is new: not yet shown
    from the other."""
    other = self._seen['log' if source == 'pipe' else 'pipe']
    if other[line]:
      other[line] -= 1
      return False
    self._seen[source][line] += 1
    return True

  def Close(self):
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None
      os.remove(self.path)


def ShowNewLines(task, output: Output, stream_logs: bool,
                 seen=None) -> None:
  """Puts the lines `task` (a cluster_tasks.Task) logged since the last call.

  Every line with `stream_logs`, prefixed with the task's name; else the
  lines SHOWN matches. Its error pipe's lines first (task.errors, an
  ErrorPipe, or None): each `error:` line is put once. `seen(task, line)`,
  if given, is called with each line of the log after it is put.
  """
  errors = getattr(task, 'errors', None)
  for line in errors.Lines() if errors else ():
    if line.startswith('error:') and errors.FirstTime(line, 'pipe'):
      output.Put(f'[{task.name}] {line}')
  if not task.log_path or not os.path.exists(task.log_path):
    return
  with open(task.log_path, 'rb') as f:
    f.seek(task.log_pos)
    data = f.read(1 << 22)
  task.log_pos += len(data)
  lines = (task.partial + data).split(b'\n')
  task.partial = lines.pop()
  for raw in lines:
    line = raw.decode('utf-8', 'replace')
    if errors and line.startswith('error:') and not errors.FirstTime(
        line, 'log'):
      continue  # Shown from the pipe.
    if stream_logs:
      output.Put(f'[{task.name}] {line}', keep=False)
    elif SHOWN.match(line):
      output.Put(f'[{task.name}] {line}')
    if seen:
      seen(task, line)


class _RelayedStderr:
  """sys.stderr whose `error:` lines also go to the launcher's pipe, first;
  a write the stream refuses (a full disk) is dropped, not raised."""

  def __init__(self, stream, fd):
    self._stream = stream
    self._fd = fd
    self._partial = ''

  def write(self, text):
    lines = (self._partial + text).split('\n')
    self._partial = lines.pop()
    for line in lines:
      if line.startswith('error:'):
        try:
          os.write(self._fd, (line + '\n').encode('utf-8', 'replace'))
        except OSError:
          pass  # The launcher is gone: the log has it.
    try:
      return self._stream.write(text)
    except (OSError, ValueError):
      return len(text)

  def flush(self):
    try:
      self._stream.flush()
    except (OSError, ValueError):
      pass

  def __getattr__(self, name):
    return getattr(self._stream, name)


def RelayErrorLines() -> None:
  """In a task the launcher started: its `error:` lines on stderr also go to
  the launcher's pipe (ERROR_PIPE_ENV), which a full disk cannot stop.

  Called at the trainer's entry point; the variable is taken out of the
  environment, so a program the task starts does not write there.
  """
  path = os.environ.pop(ERROR_PIPE_ENV, None)
  if not path or isinstance(sys.stderr, _RelayedStderr):
    return
  try:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
  except OSError:
    return  # No launcher reads it: the log alone.
  sys.stderr = _RelayedStderr(sys.stderr, fd)


def LastLines(log_path: str, n: int = 8) -> str:
  """The last n lines of a task's log, indented for a launcher message."""
  try:
    with open(log_path, 'rb') as f:
      f.seek(max(0, os.path.getsize(log_path) - 16384))
      lines = f.read().decode('utf-8', 'replace').splitlines()
  except OSError:
    return ''
  return ''.join(f'  | {l}\n' for l in lines[-n:])


def OpenErrorPipes(tasks) -> str:
  """An ErrorPipe for each task (its `errors`), in a new temp folder: its
  path. Not in the logdir: that disk may be the one that fills."""
  folder = tempfile.mkdtemp(prefix='lingvo_ext_launch_')
  for t in tasks:
    t.errors = ErrorPipe(os.path.join(folder, f'{t.job}.{t.task}.errors'))
  return folder


def CloseErrorPipes(tasks, folder: str) -> None:
  for t in tasks:
    if getattr(t, 'errors', None):
      t.errors.Close()
  if os.path.isdir(folder):
    os.rmdir(folder)
