"""What the launcher prints of its tasks, from a writer thread of its own.

The tasks write their whole output to LOGDIR/launch/JOB.TASK.log; the
launcher shows the lines `SHOWN` matches (or every line with --stream_logs)
through `Output`, so a slow reader of its output never blocks a task.
"""

import collections
import os
import re
import threading
import time

# Lines of a task's log shown without --stream_logs: the trainer's progress
# line and the tasks' own one-line messages (not Lingvo's and TensorFlow's
# INFO log records).
SHOWN = re.compile(
    r'^(step \d+/\d+ |error:|warning:|note:|interrupted|TF_CONFIG:|Slurm:|'
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


def ShowNewLines(task, output: Output, stream_logs: bool) -> None:
  """Puts the lines `task` (a cluster_tasks.Task) logged since the last call.

  Every line with `stream_logs`, prefixed with the task's name; else the
  lines SHOWN matches.
  """
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
    if stream_logs:
      output.Put(f'[{task.name}] {line}', keep=False)
    elif SHOWN.match(line):
      output.Put(f'[{task.name}] {line}')


def LastLines(log_path: str, n: int = 8) -> str:
  """The last n lines of a task's log, indented for a launcher message."""
  try:
    with open(log_path, 'rb') as f:
      f.seek(max(0, os.path.getsize(log_path) - 16384))
      lines = f.read().decode('utf-8', 'replace').splitlines()
  except OSError:
    return ''
  return ''.join(f'  | {l}\n' for l in lines[-n:])
