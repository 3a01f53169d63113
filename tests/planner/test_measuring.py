"""The plans --measure times (measuring.py)."""

from tests.support import planner_testlib as lib


def test_measure_candidates_add_the_twins():
  from lingvo_ext.planner import measuring  # pylint: disable=g-import-not-at-top
  ranked = [lib.Predicted(p, t) for p, t in zip(
      [lib.Plan(2, 4, recompute=True), lib.Plan(1, 1), lib.Plan(2, 1),
       lib.Plan(2, 4)],
      (1.0, 1.1, 1.2, 1.3))]
  out = measuring.MeasureCandidates(ranked, 2, within=1.)
  assert [p.Key() for p in out] == ['K2xR1 M4 unrolled+rc',
                                    'K1xR1 M1 unrolled', 'K2xR1 M4 unrolled']


def test_measure_candidates_are_those_predicted_close_to_the_best():
  """--measure times the plans predicted within --measure_within of the
  best (at most --measure_top): the predictions cannot tell them apart."""
  from lingvo_ext.planner import measuring  # pylint: disable=g-import-not-at-top
  ranked = [lib.Predicted(p, t) for p, t in zip(
      [lib.Plan(1, 1), lib.Plan(2, 1), lib.Plan(2, 2), lib.Plan(1, 2),
       lib.Plan(1, 4)],
      (1.0, 1.05, 1.14, 1.16, 1.5))]
  keys = lambda plans: [p.Key() for p in plans]
  assert keys(measuring.MeasureCandidates(ranked, 8, within=0.15)) == keys(
      ranked[:3])
  assert keys(measuring.MeasureCandidates(ranked, 2, within=0.15)) == keys(
      ranked[:2])
  # The predicted best always, alone where nothing is close.
  assert keys(measuring.MeasureCandidates(ranked, 8, within=0.)) == keys(
      ranked[:1])
  assert keys(measuring.MeasureCandidates(ranked, 8, within=1.)) == keys(
      ranked)
