"""Timing plans: round robin in one process, peak RSS in fresh processes.

`--measure` of `lingvo_ext.tools.plan` and the calibration's reference plans
(`auto.Machine`) time plans here; `planner.MeasuredChoice` chooses among them.
"""

import multiprocessing
import sys
import time
from typing import Dict
from typing import List
from typing import Optional

from lingvo_ext import planner

# Timed rounds of --measure and of the calibration's reference plans: a
# round is one step of each plan, milliseconds on small models, so rounds are
# cheap beside building the plans, and a candidate needs several
# (planner.MinRounds) to show that it beats the predicted best.
MEASURE_STEPS = 20
# --measure's defaults: it times the plans predicted within MEASURE_WITHIN of
# the predicted best, at most MEASURE_TOP of them: on tiny models the
# predictions do not tell plans this close apart (docs/benchmarks.md,
# "Planner").
MEASURE_WITHIN = 0.15
MEASURE_TOP = 8
MEASURE_WARMUP = 2


def Steady(times) -> float:
  """The step of a reference as the plan check measures the run's: the
  median (the fastest round is the one least shared with other processes,
  which a run's steady step is not)."""
  import statistics  # pylint: disable=g-import-not-at-top
  return statistics.median(times)


def RoundRobin(runs, rounds: int, warmup: int) -> List[List[float]]:
  """Seconds of each run() over `rounds` rounds, taken in turn (the order
  rotating each round), so that load that comes and goes hits all alike."""
  for run in runs:
    for _ in range(warmup):
      run()
  times = [[] for _ in runs]
  order = list(range(len(runs)))
  for r in range(rounds):
    k = r % len(order)
    for i in order[k:] + order[:k]:
      t = time.perf_counter()
      runs[i]()
      times[i].append(time.perf_counter() - t)
  return times


class Measurer:
  """Runs jobs in fresh processes forked from a server that has imported TF.

  Each job gets its own process, so its peak RSS is its own; the fork server
  (multiprocessing's forkserver, with `preload` imported once) saves the
  import of TensorFlow per job.
  """

  def __init__(self, fn, preload: List[str], timeout_s: float = 300):
    self._ctx = multiprocessing.get_context('forkserver')
    self._ctx.set_forkserver_preload(preload)
    self._fn = fn
    self.timeout_s = timeout_s

  def Measure(self, job: Dict) -> Dict:
    try:
      with self._ctx.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply_async(self._fn, (job,)).get(self.timeout_s)
    except Exception as e:  # pylint: disable=broad-except
      print('[plan] measuring %s failed: %r' % (job.get('plan', {}).get(
          'key', job), e), file=sys.stderr, flush=True)
      return dict(step_s=None, rss_bytes=None, error=repr(e))


def MeasurePlans(model: str, plans: List[planner.Candidate],
                 steps: int = MEASURE_STEPS,
                 warmup: int = MEASURE_WARMUP,
                 overrides: str = '', apply=None) -> List[planner.Candidate]:
  """The candidates with their Measurement: step times and peak RSS.

  Step times: all plans built in this process and timed in turn, `steps`
  rounds (RoundRobin), the fastest round (the least disturbed by other
  processes); peak RSS: each plan in a fresh process. `overrides`: the
  user's --model_params_override, applied before each plan's; `apply`:
  BuildExperimentStep's (e.g. the plan applied, then XLA's 'auto' resolved).
  """
  built = [planner.BuildExperimentStep(model, p, overrides, apply=apply)
           for p in plans]
  times = RoundRobin([lambda s=s: s[0].run(s[1]) for s in built], steps,
                     warmup)
  for sess, _ in built:
    sess.close()
  measurer = Measurer(planner.MeasureJob, ['lingvo_ext.planner'])
  out = []
  for p, t in zip(plans, times):
    rss = measurer.Measure(dict(model=model, plan=p.plan.ToDict(), steps=2,
                                warmup=0, overrides=overrides)
                          ).get('rss_bytes')
    out.append(p.Measured(step_s=min(t), times=t, rss_bytes=rss))
  return out


def MeasureCandidates(ranked: List[planner.Candidate], top: int,
                      within: float = MEASURE_WITHIN
                     ) -> List[planner.Candidate]:
  """The plans --measure times, the predicted best first.

  The predicted best and every plan predicted within `within` of its step
  time (the predictions' own error: one of them may well be the fastest),
  at most `top` in predicted order; and for each that recomputes, its twin
  without recompute if it fits (planner.MeasuredChoice prefers it within
  noise).
  """
  bound = ranked[0].step_s * (1. + within) if ranked else 0.
  out = [p for p in ranked[:top] if p is ranked[0] or p.step_s <= bound]
  for p in list(out):
    twin = planner.Twin(p, ranked)
    if twin is not None and twin not in out:
      out.append(twin)
  return out


def TooFewRounds(flag: str, rounds: int, measure_top: int) -> Optional[str]:
  """A one-line message if `rounds` timed rounds (flag `flag`) are too few
  for the --measure choice among measure_top candidates, else None."""
  # Each candidate may bring its twin without recompute.
  least = planner.MinRounds(2 * measure_top)
  if rounds >= least:
    return None
  return ('%s=%d: with --measure_top=%d a candidate needs at least %d rounds '
          'to beat the predicted best; pass %s=%d or more (default %d).' % (
              flag, rounds, measure_top, least, flag, least, MEASURE_STEPS))
