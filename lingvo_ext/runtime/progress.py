"""Readable trainer output: one progress line, Lingvo's full log in a file.

By default the trainer prints a line like

  step 120/5000  loss 2.3456  3.10 steps/s  99.2 examples/s  ETA 26m12s

every few seconds to stdout, and Lingvo's INFO log (thousands of lines of
params, variable placement, per-step metrics) goes to <logdir>/log.<job>.txt.
--alsologtostderr also prints that log to stderr, --logtostderr only there
(absl's flags).
"""

import collections
import logging
import os
import re
import sys
import time
import traceback

from absl import flags
from absl import logging as absl_logging

FLAGS = flags.FLAGS

# Seconds over which steps/s is averaged, and between two progress lines.
RATE_WINDOW_S = 30.0
PRINT_INTERVAL_S = 2.0
# A gap between two steps longer than this, and than PAUSE_STEPS of the
# window's steps, is a pause (a stalled input, a slow save): it is named on
# the line and left out of the rate, which goes on from the steps after it.
PAUSE_S = 10.0
PAUSE_STEPS = 10


def FormatDuration(seconds: float) -> str:
  """'1h02m', '26m12s' or '9s'."""
  seconds = int(round(seconds))
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  if h:
    return f'{h}h{m:02d}m'
  if m:
    return f'{m}m{s:02d}s'
  return f'{s}s'


class Progress:
  """Prints step/max, loss, steps/s, examples/s and ETA, now and then.

  The rates are those of the last RATE_WINDOW_S seconds of steps; a pause
  (PAUSE_S) restarts the window, the rate before it standing until two steps
  after it are in, so one stall neither drags the ETA out for a window's
  length nor hides in it.
  """

  def __init__(self, max_steps, stream=None, interval_s=PRINT_INTERVAL_S,
               clock=time.time):
    self._max_steps = max_steps
    self._stream = stream
    self._interval_s = interval_s
    self._clock = clock
    self._window = collections.deque()  # (time, step, examples so far)
    self._examples = 0.0
    self._last_print = None
    self._rates = None  # (steps/s, examples/s) of the window before a pause.
    self._pause = 0.0  # Seconds of the pause not yet named on a line.

  def _IsPause(self, now):
    if len(self._window) < 2:
      return False
    (t0, s0, _), (t1, s1, _) = self._window[0], self._window[-1]
    per_step = (t1 - t0) / max(s1 - s0, 1)
    return now - t1 > max(PAUSE_S, PAUSE_STEPS * per_step)

  def _Rates(self, now, step):
    """(steps/s, examples/s) of the window, or None."""
    t0, s0, e0 = self._window[0]
    if now > t0 and step > s0:
      return (step - s0) / (now - t0), (self._examples - e0) / (now - t0)
    return None

  def Line(self, step, loss, examples_in_batch):
    """Records a finished step; returns its progress line."""
    now = self._clock()
    if self._IsPause(now):
      self._rates = self._Rates(*self._window[-1][:2]) or self._rates
      self._pause = max(self._pause, now - self._window[-1][0])
      self._window.clear()
    self._examples += examples_in_batch
    self._window.append((now, step, self._examples))
    while len(self._window) > 2 and now - self._window[0][0] > RATE_WINDOW_S:
      self._window.popleft()
    rates = self._Rates(now, step) or self._rates
    parts = [f'step {step}/{self._max_steps}', f'loss {loss:.4f}']
    if rates:
      steps_per_s, examples_per_s = rates
      parts.append(f'{steps_per_s:.2f} steps/s')
      parts.append(f'{examples_per_s:.1f} examples/s')
      left = max(self._max_steps - step, 0)
      parts.append(f'ETA {FormatDuration(left / steps_per_s)}')
    else:
      parts.append('(measuring speed)')
    if self._pause:
      parts.append(f'(after a {FormatDuration(self._pause)} pause)')
    return '  '.join(parts)

  def Restart(self):
    """The rates start again from the next step (after time not spent
    training, e.g. the plan check's wait for its prediction)."""
    self._window.clear()

  def Update(self, step, loss, examples_in_batch):
    """Records a step; prints its line if it is time (or the last step)."""
    line = self.Line(step, loss, examples_in_batch)
    now = self._clock()
    if (self._last_print is None or now - self._last_print >= self._interval_s
        or step >= self._max_steps):
      self._last_print = now
      self._pause = 0.0  # Named once.
      stream = self._stream or sys.stdout
      print(line, file=stream, flush=True)


def LogFilePath(logdir, job, task=None):
  """<logdir>/log.<job>.txt, the job's commas made '+'.

  A cluster's task (`task` given) has its own: <logdir>/log.<job>.<task>.txt.
  """
  name = re.sub(r'[^\w.+-]', '+', job)
  if task is not None:
    name = f'{name}.{task}'
  return os.path.join(logdir, f'log.{name}.txt')


class _LogFile:
  """The log file, kept usable to the very end of the process.

  Python's logging closes handlers' streams at exit, and objects collected
  after that still log (TF's tf_should_use does): writing to a closed file
  would print '--- Logging error ---' with a traceback. Here `close` only
  flushes; the file is closed when the process exits.

  A write that fails (a full disk) says so once on stderr and drops the
  log's lines from then on: the progress lines and errors stay on the
  console, and Python's logging prints no traceback per line.
  """

  def __init__(self, f):
    self._f = f
    self._broken = False

  def _Guard(self, call, *args):
    if self._broken:
      return None
    try:
      return call(*args)
    except (OSError, ValueError) as e:
      self._broken = True
      why = getattr(e, 'strerror', None) or e
      print(f'note: cannot write the log file {self._f.name} ({why}); '
            'its lines are dropped from now on.', file=sys.stderr,
            flush=True)
      return None

  def write(self, text):
    return self._Guard(self._f.write, text)

  def flush(self):
    self._Guard(self._f.flush)

  def close(self):
    self.flush()

  def __getattr__(self, name):
    return getattr(self._f, name)


def RouteLogToFile(path):
  """Sends the absl/Lingvo log to `path` (appending) instead of stderr.

  What still reaches stderr is absl's --stderrthreshold, which the entry
  point sets; --alsologtostderr keeps everything on stderr as well.
  """
  os.makedirs(os.path.dirname(path), exist_ok=True)
  handler = absl_logging.get_absl_handler().python_handler
  handler.stream = _LogFile(open(path, 'a', encoding='utf-8'))  # pylint: disable=consider-using-with


def KeepErrorsInLogFile():
  """From now on, errors the log gets go to the log file only.

  For a job that said its fault in its own one line and is ending: the
  traceback Lingvo logs at ERROR would follow it on stderr
  (--stderrthreshold). Nothing changes when the log is stderr itself or
  --alsologtostderr is given.
  """
  handler = absl_logging.get_absl_handler().python_handler
  if isinstance(handler.stream, _LogFile) and not FLAGS.alsologtostderr:
    FLAGS.stderrthreshold = 'fatal'


def SessionCloseErrorsToLogFile(hook):
  """A threading.excepthook: TensorFlow's SessionCloseThread to the log.

  A session left by a failed step is closed in that thread (tf.Session's
  exit), which fails too when a task of the cluster is lost; the step's own
  error has its line. Other threads' exceptions go to `hook`.
  """

  def Hook(args):
    if args.thread is None or args.thread.name != 'SessionCloseThread':
      hook(args)
      return
    text = ''.join(traceback.format_exception(args.exc_type, args.exc_value,
                                              args.exc_traceback))
    LogToFileOnly(f'Closing a session failed:\n{text}')

  return Hook


def LogToFileOnly(message, level=logging.ERROR):
  """Writes `message` to the log file, never to stderr.

  For a fault the caller says on stderr in its own one line (`error: ...`):
  absl would echo an ERROR record there too (--stderrthreshold), two lines
  for one fault. Nothing is logged when the log is stderr itself.
  """
  handler = absl_logging.get_absl_handler().python_handler
  if not isinstance(handler.stream, _LogFile):
    return
  record = logging.LogRecord('absl', level, __file__, 0, '%s', (message,),
                             None)
  logging.StreamHandler.emit(handler, record)  # The file, not the echo.
  handler.stream.flush()
