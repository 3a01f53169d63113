"""The choice among predicted (and measured) plans (pure Python).

`Rank` orders candidates by predicted (or measured) step time within a memory
budget; `MeasuredChoice` picks among measured candidates by a sign test over
paired rounds; `Choose` enumerates, predicts and ranks.
"""

import dataclasses
import math
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo_ext.pipeline import records
from lingvo_ext.planner.model_profile import FormatSize
from lingvo_ext.planner.model_profile import Machine
from lingvo_ext.planner.model_profile import ModelProfile
from lingvo_ext.planner.plans import Candidate
from lingvo_ext.planner.plans import Enumerate
from lingvo_ext.planner.plans import PlanError
from lingvo_ext.planner.plans import PlanOf
from lingvo_ext.planner.prediction import PredictAll


def Rank(plans: Sequence[Candidate],
         memory_per_device: Optional[float] = None,
         measured: bool = False) -> List[Candidate]:
  """Candidates within the budget, fastest first (measured time first if asked).

  Ties (within 0.5%) go to fewer devices, then less memory.

  Raises:
    PlanError: no plan fits the budget; names the least memory that would.
  """
  fits = [p for p in plans
          if memory_per_device is None or p.peak_bytes <= memory_per_device]
  if not fits:
    if not plans:
      raise PlanError('no plan: no (cells, micro-batches, replicas) divides '
                      'the batch; pass another --global_batch.')
    least = min(p.peak_bytes for p in plans)
    raise PlanError(
        '--memory_per_device=%s fits no plan; the smallest that fits one is '
        '%s (pass --memory_per_device=%s or more, or more --devices).' %
        (FormatSize(memory_per_device), FormatSize(least),
         FormatSize(math.ceil(least / 2**20) * 2**20)))

  def Time(p):
    if measured and p.measured_step_s is not None:
      return p.measured_step_s
    return p.step_s

  best = min(Time(p) for p in fits)
  return sorted(fits, key=lambda p: (
      (0 if measured and p.measured_step_s is not None else 1),
      round(math.log(max(Time(p), 1e-12) / max(best, 1e-12)) / 0.005),
      p.devices, p.peak_bytes))


# --measure's significance: a candidate replaces the predicted best only if
# a fair coin would beat it in as many paired rounds with probability at most
# this, over the number of candidates compared (a sign test with Bonferroni's
# correction).
MEASURE_ALPHA = 0.05


def Twin(plan, plans: Sequence):
  """The same plan without recompute among `plans`, if `plan` recomputes
  (by choice, not 'recurrent', which always does) and it is there."""
  if not plan.recompute or plan.schedule in records.ALWAYS_RECOMPUTE:
    return None
  want = dataclasses.replace(PlanOf(plan), recompute=False).Key()
  return next((p for p in plans if p.Key() == want), None)


def MeasuredNoise(plans: Sequence[Candidate]) -> float:
  """The relative noise of the measured rounds: the median over plans of
  (median round - fastest round) / fastest round."""
  spreads = []
  for p in plans:
    if getattr(p, 'measured_times', None):  # A bare Plan has none.
      fastest = min(p.measured_times)
      mid = sorted(p.measured_times)[(len(p.measured_times) - 1) // 2]
      spreads.append((mid - fastest) / max(fastest, 1e-12))
  spreads.sort()
  return spreads[(len(spreads) - 1) // 2] if spreads else 0.


def SignTestP(wins: int, rounds: int) -> float:
  """P(a fair coin comes up heads in at least `wins` of `rounds` tosses)."""
  return sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2.**rounds


def MinRounds(num_candidates: int, alpha: float = MEASURE_ALPHA) -> int:
  """The fewest paired rounds in which a candidate that wins every round
  beats the predicted best among `num_candidates` (MeasuredChoice)."""
  others = max(num_candidates - 1, 1)
  return max(1, math.ceil(math.log2(others / alpha)))


def MeasuredChoice(candidates: Sequence[Candidate],
                   alpha: float = MEASURE_ALPHA) -> Tuple[Candidate, float]:
  """The plan --measure picks among measured candidates, and the noise.

  The candidates' `measured_times` are paired rounds: RoundRobin times each
  candidate once per round, so round r of one and of another ran under the
  same load. A candidate is faster than the predicted best (the first
  candidate) if it beat it in so many rounds that a fair coin would with
  probability at most alpha over the number of other candidates (a one-sided
  sign test, Bonferroni-corrected: a gap smaller than the rounds' spread
  counts once it holds round after round, and one lucky round does not).
  Of the predicted best and the candidates faster than it, the one with the
  least fastest round is taken. A recomputing plan runs its twin's steps and
  more: where its twin without recompute was measured, each of its rounds
  counts as no faster than the twin's, and a recomputing pick gives way to
  its twin.

  Args:
    candidates: Measured plans, the predicted best first, each with as many
      rounds.
    alpha: The test's significance over all candidates.

  Returns:
    (the chosen plan, the rounds' relative noise: MeasuredNoise).
  """
  measured = [p for p in candidates if getattr(p, 'measured_times', None)]
  if not measured:
    raise ValueError('MeasuredChoice: no candidate has measured_times.')
  if len({len(p.measured_times) for p in measured}) != 1:
    raise ValueError('MeasuredChoice: the candidates have different numbers '
                     'of rounds; they must be timed in the same rounds.')

  def Rounds(p):
    twin = Twin(p, measured)
    if twin is None:
      return list(p.measured_times)
    return [max(a, b) for a, b in zip(p.measured_times, twin.measured_times)]

  rounds = [Rounds(p) for p in measured]
  base = rounds[0]  # The predicted best's.
  bound = alpha / max(len(measured) - 1, 1)
  faster = [0] + [
      i for i in range(1, len(measured))
      if SignTestP(sum(a < b for a, b in zip(rounds[i], base)),
                   len(base)) <= bound]
  chosen = measured[min(faster, key=lambda i: min(rounds[i]))]
  twin = Twin(chosen, measured)
  if twin is not None:
    chosen = twin
  return chosen, MeasuredNoise(measured)


def Choose(profile: ModelProfile, devices: int,
           memory_per_device: Optional[float] = None,
           global_batch: Optional[int] = None,
           machine: Machine = Machine(),
           **enumerate_kwargs) -> List[Candidate]:
  """The ranked, predicted plans that fit (see Enumerate and Rank)."""
  plans = PredictAll(
      profile, Enumerate(profile, devices, global_batch, **enumerate_kwargs),
      machine)
  return Rank(plans, memory_per_device)
