"""Ranking and the --measure choice (choice.py)."""

import pytest

from lingvo_ext import planner
from tests.support import planner_testlib as lib


def test_budget_drops_plans_and_names_the_least_that_fits():
  profile = lib.Profile()
  plans = planner.PredictAll(profile, planner.Enumerate(profile, 4),
                             lib.FLOPS_ONLY)
  least = min(p.peak_bytes for p in plans)
  budget = sorted(p.peak_bytes for p in plans)[len(plans) // 2]
  fits = planner.Rank(plans, budget)
  assert fits and all(p.peak_bytes <= budget for p in fits)
  assert len(fits) < len(plans)
  with pytest.raises(planner.PlanError) as e:
    planner.Rank(plans, least - 1)
  message = str(e.value)
  assert '\n' not in message
  assert planner.FormatSize(least) in message


def test_rank_is_fastest_first():
  profile = lib.Profile()
  plans = planner.Rank(planner.PredictAll(
      profile, planner.Enumerate(profile, 4), lib.FLOPS_ONLY))
  times = [p.step_s for p in plans]
  # Within the 0.5% tie band, the order is by time.
  assert all(b >= a * 0.995 for a, b in zip(times, times[1:]))


def test_measured_noise_is_the_median_spread():
  # Median 10% over the least.
  a = lib.Measured(lib.Plan(1, 1), [1.0, 1.1, 1.2])
  b = lib.Measured(lib.Plan(2, 1), [2.0, 2.6, 2.4])   # 20%.
  c = lib.Measured(lib.Plan(2, 4), [1.0, 1.3, 1.01])  # 1%.
  assert planner.MeasuredNoise([a, b, c]) == pytest.approx(0.1)
  assert planner.MeasuredNoise([c]) == pytest.approx(0.01)
  assert planner.MeasuredNoise([lib.Plan(1, 1)]) == 0.


def test_measured_choice_takes_a_plan_that_wins_round_after_round():
  rounds = [1.00, 1.05, 1.04, 1.20, 1.02, 1.10, 1.01, 1.30, 1.03, 1.06]
  predicted = lib.Measured(lib.Plan(1, 1), rounds)  # Spread 4-30%.
  # 2% faster in every round, under the rounds' spread: a real gain.
  steady = lib.Measured(lib.Plan(2, 1), [0.98 * t for t in rounds])
  chosen, noise = planner.MeasuredChoice([predicted, steady])
  assert chosen is steady
  assert noise == pytest.approx(0.04)
  # One lucky round, slower in the rest: its fastest round is no reason.
  lucky = lib.Measured(lib.Plan(2, 4), [0.5] + [1.4] * 9)
  assert planner.MeasuredChoice([predicted, lucky])[0] is predicted
  # Of two that win every round, the one with the faster rounds.
  fast = lib.Measured(lib.Plan(2, 4), [0.8 * t for t in rounds])
  assert planner.MeasuredChoice([predicted, steady, fast])[0] is fast
  # Candidates measured nowhere, or in different rounds: plain errors.
  with pytest.raises(ValueError):
    planner.MeasuredChoice([lib.Plan(1, 1)])
  with pytest.raises(ValueError):
    planner.MeasuredChoice([predicted, lib.Measured(lib.Plan(2, 1), [1.0])])


@pytest.mark.parametrize('num_candidates', [2, 3, 8, 16])
def test_measured_choice_needs_more_wins_among_more_candidates(
    num_candidates):
  """A sign test over all candidates: the bound tightens with their number
  (Bonferroni), so that the best of many noisy candidates is not taken for
  a faster one."""
  least = planner.MinRounds(num_candidates)
  for n, wins, chosen in ((least, least, True), (least - 1, least - 1, False),
                          (least + 4, least + 4, True)):
    predicted = lib.Measured(lib.Plan(1, 1), [1.0] * n)
    # Faster by half in `wins` rounds, slower in the others.
    other = lib.Measured(lib.Plan(2, 1), [0.5] * wins + [1.5] * (n - wins))
    slow = [lib.Measured(lib.Plan(2, 4, replicas=1 + i), [2.0] * n)
            for i in range(num_candidates - 2)]
    pick, _ = planner.MeasuredChoice([predicted, other] + slow)
    assert (pick is other) == chosen, (n, wins)
  # One round lost of least + 4: still chosen where the test allows it.
  n = least + 4
  p = planner.SignTestP(n - 1, n)
  other = lib.Measured(lib.Plan(2, 1), [0.5] * (n - 1) + [1.5])
  predicted = lib.Measured(lib.Plan(1, 1), [1.0] * n)
  slow = [lib.Measured(lib.Plan(2, 4, replicas=1 + i), [2.0] * n)
          for i in range(num_candidates - 2)]
  pick, _ = planner.MeasuredChoice([predicted, other] + slow)
  assert (pick is other) == (
      p <= planner.MEASURE_ALPHA / (num_candidates - 1))


def test_sign_test_p():
  assert planner.SignTestP(0, 5) == 1.
  assert planner.SignTestP(5, 5) == pytest.approx(1 / 32)
  assert planner.SignTestP(8, 10) == pytest.approx(56 / 1024)
  assert planner.MinRounds(2) == 5   # 1/32 <= 0.05 < 1/16.
  assert planner.MinRounds(16) == 9  # 1/512 <= 0.05 / 15 < 1/256.


def test_measured_choice_never_picks_noise_for_recompute():
  """A recomputing plan runs its twin's steps and more: its faster rounds
  are noise, so each counts as no faster than its twin's, and the twin is
  taken."""
  twin = lib.Measured(lib.Plan(1, 1), [1.0, 1.3, 1.4, 1.0, 1.1] * 2)
  rc = lib.Measured(lib.Plan(1, 1, recompute=True),
                    [0.7, 1.2, 1.4, 0.9, 1.0] * 2)
  other = lib.Measured(lib.Plan(2, 4), [1.05, 1.35, 1.45, 1.05, 1.15] * 2)
  assert planner.Twin(rc, [twin, rc, other]) is twin
  assert planner.Twin(twin, [twin, rc, other]) is None
  # The predicted best: rc; as fast as its twin round by round, so its twin.
  assert planner.MeasuredChoice([rc, other, twin])[0] is twin
  # Without the twin measured, rc's rounds stand: they beat other's in every
  # round.
  assert planner.MeasuredChoice([other, rc])[0] is rc
