"""The run's plan checked against what it measured: the `plan check:` line.

Once the step rate is steady (after `Thresholds.min_steps` steps and
`min_seconds` seconds, whichever comes later, both counted from the
prediction's arrival), the trainer prints, once:

  plan check: step 41.2 ms, predicted 39.5 ms (-4%); peak memory 1104 MB,
  predicted 1050 MB (-5%)

(one line): the steady step is the median, over the last `min_steps` steps,
of the mean step of each of STEADY_GROUPS runs of steps in a row (a
bucketed input's batches differ in length: one step is its bucket's, a run
of steps the mix's; the median leaves out a slow step, e.g. a save),
the peak memory the process's peak RSS (VmHWM), each percentage
predicted / measured - 1. Where one is off by more than OFF_BY, a second
line names the prediction's largest term and the command that recalibrates.
The line goes to the console, the log file and TensorBoard (scalars under
`plan_check/`). A run too short for that prints nothing. The prediction
itself is plan_prediction.py's. docs/performance.md, "The plan check".
"""

import dataclasses
import logging
import statistics
import sys
import time
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo_ext import child_peak

# When the step rate counts as steady (--plan_check_steps, --plan_check_secs).
MIN_STEPS = 50
MIN_SECONDS = 30.
# An error beyond this names its largest term and the recalibration.
OFF_BY = 0.25
# The runs of steps in a row whose mean steps the steady step is the median of.
STEADY_GROUPS = 5
MB = 2.**20


@dataclasses.dataclass(frozen=True)
class Thresholds:
  """When the step rate counts as steady: both reached, counted from the
  prediction's arrival."""
  min_steps: int = MIN_STEPS
  min_seconds: float = MIN_SECONDS


@dataclasses.dataclass(frozen=True)
class Predicted:
  """What the planner predicts of the run's plan.

  Attributes:
    step_s: The step's seconds.
    rss_bytes: The process's peak resident set.
    step_terms: (what, seconds) that make up step_s.
    rss_terms: (what, bytes) that make up rss_bytes.
    recalibrate: The command that calibrates the step's model again.
    recalibrate_memory: The command that calibrates the memory model again.
    loop_s: The trainer loop's own time in step_s (its probe's), replaced by
      the loop's time measured in the run where the run measures it
      (WithMeasuredLoop).
  """
  step_s: float
  rss_bytes: float
  step_terms: Tuple[Tuple[str, float], ...] = ()
  rss_terms: Tuple[Tuple[str, float], ...] = ()
  recalibrate: str = ''
  recalibrate_memory: str = ''
  loop_s: float = 0.

  def ToDict(self) -> Dict:
    out = dataclasses.asdict(self)
    out['step_terms'] = [list(t) for t in self.step_terms]
    out['rss_terms'] = [list(t) for t in self.rss_terms]
    return out

  @classmethod
  def FromDict(cls, d: Dict) -> 'Predicted':
    d = dict(d)
    d['step_terms'] = tuple(tuple(t) for t in d.get('step_terms', ()))
    d['rss_terms'] = tuple(tuple(t) for t in d.get('rss_terms', ()))
    return cls(**d)


# The loop's term as its probe predicts it (plan_prediction) and as the run
# measures it (WithMeasuredLoop, which puts the one in the other's place).
PROBED_LOOP_TERM = ("the trainer loop's own time (global step reads, "
                    'summaries, log line)')
LOOP_TERM = ("the trainer loop's own time, measured in this run (from one "
             "step's Session.run to the next: global step reads, summaries, "
             'log line)')


def WithMeasuredLoop(predicted: Predicted, step_s: float,
                     run_s: float) -> Predicted:
  """`predicted` with its loop term the run's own: the steady step less the
  steady Session.run of the training step (the model predicts the latter).
  """
  loop = max(step_s - run_s, 0.)
  terms = tuple(t for t in predicted.step_terms
                if t[0] != PROBED_LOOP_TERM) + ((LOOP_TERM, loop),)
  return dataclasses.replace(
      predicted, step_s=predicted.step_s - predicted.loop_s + loop,
      step_terms=terms, loop_s=loop)


def Steady(times: Sequence[float]) -> float:
  """The median of the means of `times` cut into STEADY_GROUPS runs in a row
  (from the last; the oldest times beyond whole runs left out)."""
  n = max(len(times) // STEADY_GROUPS, 1)
  groups = [times[i - n:i] for i in range(len(times), n - 1, -n)]
  return statistics.median(statistics.fmean(g) for g in groups)


def Error(predicted: float, measured: float) -> float:
  """predicted / measured - 1."""
  return predicted / measured - 1.


def _Percent(error: float) -> str:
  return '%+.0f%%' % (100. * error) if round(100. * error) else '0%'


def Line(step_s: float, rss_bytes: float, predicted: Predicted) -> str:
  """The `plan check:` line of a measured step and peak RSS."""
  return ('plan check: step %.1f ms, predicted %.1f ms (%s); peak memory '
          '%.0f MB, predicted %.0f MB (%s)' % (
              1e3 * step_s, 1e3 * predicted.step_s,
              _Percent(Error(predicted.step_s, step_s)), rss_bytes / MB,
              predicted.rss_bytes / MB,
              _Percent(Error(predicted.rss_bytes, rss_bytes))))


def _Off(what: str, error: float, terms: Sequence[Tuple[str, float]],
         total: float, unit: Callable[[float], str], command: str) -> str:
  low = 'low' if error < 0 else 'high'
  text = f'plan check: the {what} is predicted {abs(100 * error):.0f}% {low}'
  if terms:
    name, value = max(terms, key=lambda t: abs(t[1]))
    text += (f'; its largest term is {name} ({unit(value)} of '
             f'{unit(total)})')
  if command:
    text += f'; recalibrate with: {command}'
  return text + '.'


def OffLines(step_s: float, rss_bytes: float,
             predicted: Predicted) -> List[str]:
  """The lines for each figure off by more than OFF_BY (else none)."""
  out = []
  step_error = Error(predicted.step_s, step_s)
  if abs(step_error) > OFF_BY:
    out.append(_Off('step', step_error, predicted.step_terms,
                    predicted.step_s, lambda s: '%.1f ms' % (1e3 * s),
                    predicted.recalibrate))
  rss_error = Error(predicted.rss_bytes, rss_bytes)
  if abs(rss_error) > OFF_BY:
    out.append(_Off('peak memory', rss_error, predicted.rss_terms,
                    predicted.rss_bytes, lambda b: '%.0f MB' % (b / MB),
                    predicted.recalibrate_memory or predicted.recalibrate))
  return out


def Scalars(step_s: float, rss_bytes: float,
            predicted: Predicted) -> Dict[str, float]:
  """The TensorBoard scalars of the check."""
  return {
      'plan_check/step_ms': 1e3 * step_s,
      'plan_check/predicted_step_ms': 1e3 * predicted.step_s,
      'plan_check/step_error': Error(predicted.step_s, step_s),
      'plan_check/peak_memory_mb': rss_bytes / MB,
      'plan_check/predicted_peak_memory_mb': predicted.rss_bytes / MB,
      'plan_check/peak_memory_error': Error(predicted.rss_bytes, rss_bytes),
  }


def PeakRss() -> Optional[float]:
  """This process's peak resident set (VmHWM), bytes; None if unknown."""
  peak = child_peak.StatusBytes('VmHWM')
  return None if peak is None else float(peak)


def Emit(lines: Sequence[str], scalars: Dict[str, float], step: int,
         summary_dir: str = '', stream=None) -> None:
  """The lines on the console and in the log file; the scalars to
  TensorBoard in `summary_dir` (if given)."""
  from lingvo_ext.runtime import progress  # pylint: disable=g-import-not-at-top
  for line in lines:
    print(line, file=stream or sys.stdout, flush=True)
    progress.LogToFileOnly(line, logging.INFO)
  if summary_dir:
    import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
    summary = tf.Summary(value=[tf.Summary.Value(tag=k, simple_value=v)
                                for k, v in scalars.items()])
    with tf.Graph().as_default():  # FileWriter's v1 API, not eager.
      writer = tf.summary.FileWriter(summary_dir)
      writer.add_summary(summary, step)
      writer.close()


class PlanCheck:
  """Counts the run's steps; prints the check once, when steady.

  Args:
    predicted: A Predicted, or a callable returning one (called at the
      first step; False if it failed: no check; None: not ready yet, asked
      again at the next step).
    thresholds: When the rate counts as steady.
    emit: emit(lines, scalars, step), default Emit.
    clock: Seconds.
    rss: The process's peak RSS in bytes (default PeakRss).
  """

  def __init__(self, predicted, thresholds: Thresholds = Thresholds(),
               emit=None, clock=time.perf_counter, rss=PeakRss):
    self._predicted = predicted if callable(predicted) else (
        lambda: predicted)
    self._thresholds = thresholds
    self._emit = emit or Emit
    self._clock = clock
    self._rss = rss
    # Waits for a prediction still running (at the run's end), if given.
    self._wait = getattr(predicted, 'Wait', None)
    self._ready = None
    self._previous = None  # The last step seen and its clock.
    self._times = []  # Every interval between steps since the first.
    self._runs = []  # Each interval's step's Session.run seconds, or None.
    self._arrived = None  # (len(_times), clock) when the prediction came.
    self.done = False

  @property
  def predicted(self) -> Optional[Predicted]:
    """The prediction, once it has arrived (else None)."""
    return self._ready if isinstance(self._ready, Predicted) else None

  def Ran(self, step: int, run_s: Optional[float] = None
          ) -> Optional[List[str]]:
    """Records a finished step (`run_s`: its Session.run's seconds, where
    the trainer times it); returns the lines if it printed them."""
    if self.done:
      return None
    now = self._clock()
    if self._previous is not None:
      self._times.append(now - self._previous[1])
      self._runs.append(run_s)
    self._previous = (step, now)
    if self._ready is None:
      self._ready = self._predicted()
      if self._ready is None:
        return None  # Counted from when the prediction is ready.
      if not isinstance(self._ready, Predicted):
        self.done = True  # It failed (logged where it ran).
        return None
      self._arrived = (len(self._times), now)
      return None
    since = self._times[self._arrived[0]:]
    t = self._thresholds
    if len(since) < max(t.min_steps, 1) or (
        now - self._arrived[1] < t.min_seconds):
      return None
    return self._Check(self._arrived[0], step)

  def _Check(self, first: int, step) -> Optional[List[str]]:
    """The check over the last min_steps intervals from index `first`."""
    self.done = True
    predicted = self._ready
    rss = self._rss()
    if not rss:
      return None  # No /proc: nothing to check against.
    start = max(first, len(self._times) - max(self._thresholds.min_steps, 1))
    step_s = Steady(self._times[start:])
    runs = self._runs[start:]
    if runs and None not in runs:
      predicted = WithMeasuredLoop(predicted, step_s, Steady(runs))
    lines = [Line(step_s, rss, predicted)] + OffLines(step_s, rss, predicted)
    self._emit(lines, Scalars(step_s, rss, predicted), step)
    return lines

  def Finish(self) -> Optional[List[str]]:
    """At the run's end: a run long enough to be steady whose prediction
    came too late prints the check now (waiting for the prediction), from
    its last steps; a shorter one prints nothing."""
    if self.done or self._previous is None:
      return None
    t = self._thresholds
    if len(self._times) < max(t.min_steps, 1) or (
        sum(self._times) < t.min_seconds):
      return None
    if self._ready is None and self._wait:
      self._ready = self._wait()
    if not isinstance(self._ready, Predicted):
      self.done = True
      return None
    return self._Check(0, self._previous[0])
