"""Schedules as data: exact action lists, checks and simulation, without TF."""

import itertools
import random

import pytest

from lingvo_ext.pipeline import schedules as A


def _Str(schedule):
  return [' '.join(str(a) for a in acts) for acts in schedule]


def test_gpipe_exact_lists():
  spec = A.StageSpec(num_stages=2, num_devices=2, num_micro_batches=3)
  # Input gradients first, then one run of weight gradients per stage.
  assert _Str(A.GPipe(spec)) == [
      'F0.0 F0.1 F0.2 I0.0 I0.1 I0.2 W0.0 W0.1 W0.2',
      'F1.0 F1.1 F1.2 I1.0 I1.1 I1.2 W1.0 W1.1 W1.2',
  ]
  # Recomputing, whole backward passes: no 'W' keeps a recomputed pass.
  spec = A.StageSpec(2, 2, 2, recompute=True)
  assert _Str(A.GPipe(spec)) == [
      'F0.0 F0.1 R0.0 B0.0 R0.1 B0.1',
      'F1.0 F1.1 R1.0 B1.0 R1.1 B1.1',
  ]
  # Runs of 3 micro-batches' weight gradients, each after their 'R' and 'I'.
  spec = A.StageSpec(2, 1, 4, recompute=True, weight_gradient_run=3)
  assert _Str(A.GPipe(spec)) == [
      'F0.0 F1.0 F0.1 F1.1 F0.2 F1.2 F0.3 F1.3 '
      'R1.0 I1.0 R0.0 I0.0 R1.1 I1.1 R0.1 I0.1 R1.2 I1.2 R0.2 I0.2 '
      'W1.0 W1.1 W1.2 W0.0 W0.1 W0.2 R1.3 I1.3 R0.3 I0.3 W1.3 W0.3']
  timeline = A.Simulate(spec, A.GPipe(spec))
  assert timeline.PeakInFlight(0) == 6  # 2 stages x 3 micro-batches.
  with pytest.raises(ValueError, match='weight_gradient_run=0 must be >= 1'):
    A.StageSpec(2, 1, 4, recompute=True, weight_gradient_run=0)
  # Two stages per device: the later stage's backward first.
  spec = A.StageSpec(4, 2, 2)
  assert _Str(A.GPipe(spec)) == [
      'F0.0 F2.0 F0.1 F2.1 I2.0 I0.0 I2.1 I0.1 W2.0 W2.1 W0.0 W0.1',
      'F1.0 F3.0 F1.1 F3.1 I3.0 I1.0 I3.1 I1.1 W3.0 W3.1 W1.0 W1.1',
  ]


def test_weight_gradient_run_length():
  # Operands within one copy of the weights: 1 + weights // operands, <= M.
  assert A.WeightGradientRunLength(100, 40, 8) == 3
  assert A.WeightGradientRunLength(100, 200, 8) == 1
  assert A.WeightGradientRunLength(10**6, 1, 8) == 8
  assert A.WeightGradientRunLength(100, 0, 8) == 8  # Operands cost nothing.
  assert A.WeightGradientRunLength(0, 0, 8) == 1  # Nothing to batch.


def test_weight_gradient_runs():
  spec = A.StageSpec(4, 2, 2)
  assert [' '.join(map(str, r)) for r in A.WeightGradientRuns(
      A.GPipe(spec))] == ['W2.0 W2.1', 'W0.0 W0.1', 'W3.0 W3.1', 'W1.0 W1.1']
  # Interleaved with other actions: every 'W' its own run.
  spec = A.StageSpec(2, 2, 4)
  runs = A.WeightGradientRuns(A.ZeroBubble(spec))
  assert all(len(r) == 1 for r in runs) and len(runs) == 8
  assert A.WeightGradientRuns(A.OneFOneB(spec)) == []
  # Adjacent 'W's of two stages are two runs.
  f = lambda *a: A.Action(*a)
  assert A.WeightGradientRuns([[f('W', 0, 0), f('W', 2, 0), f('W', 2, 1),
                                f('I', 0, 1), f('W', 0, 1)]]) == [
      [f('W', 0, 0)], [f('W', 2, 0), f('W', 2, 1)], [f('W', 0, 1)]]


@pytest.mark.parametrize('k,m', [(1, 1), (2, 1), (2, 4), (3, 4), (4, 8)])
def test_critical_path_is_a_micro_batch_and_the_last_weight_run(k, m):
  # Unit costs, GPipe's lists (one run of M weight gradients per stage): the
  # longest chain is one micro-batch's K forward and K input-gradient
  # passes, then the first stage's run, which waits for all its micro-batches.
  spec = A.StageSpec(k, k, m)
  schedule = A.GPipe(spec)
  assert A.CriticalPath(spec, schedule) == 2 * k + m


@pytest.mark.parametrize('name', sorted(A.ACTION_SCHEDULES))
def test_critical_path_never_exceeds_the_lists(name):
  # Dropping the lists' order can only start actions earlier: over random
  # costs, the chain of data dependencies ends no later than the lists.
  rng = random.Random(name)
  for k, d, m, rc in ((2, 2, 4, False), (4, 2, 4, True), (4, 4, 8, False)):
    if name == 'zbv':  # Two cells on each device.
      d = k // 2
    spec = A.Placed(name, A.StageSpec(k, d, m, recompute=rc))
    schedule = A.Build(name, spec)
    costs = {a: rng.uniform(0.1, 3.) for acts in schedule for a in acts}
    assert A.CriticalPath(spec, schedule, costs.get) <= (
        A.Simulate(spec, schedule, costs.get).makespan + 1e-9)
  # An action whose input no list holds is an error, not a hang.
  with pytest.raises(ValueError, match='without their inputs: I0.0'):
    A.CriticalPath(A.StageSpec(2, 2, 1), [[A.Action('I', 0, 0)], []])


def test_1f1b_exact_lists():
  spec = A.StageSpec(num_stages=3, num_devices=3, num_micro_batches=4)
  assert _Str(A.OneFOneB(spec)) == [
      'F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3',
      'F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3',
      'F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3',
  ]
  # Fewer micro-batches than stages: warm-up takes them all.
  assert _Str(A.OneFOneB(A.StageSpec(3, 3, 1))) == ['F0.0 B0.0'] + [
      'F%d.0 B%d.0' % (s, s) for s in (1, 2)]


def test_interleaved_exact_lists():
  # 4 stages on 2 devices: device 0 holds stages 0 and 2.
  spec = A.StageSpec(num_stages=4, num_devices=2, num_micro_batches=2)
  assert _Str(A.Interleaved1F1B(spec)) == [
      'F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1',
      'F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1',
  ]
  # One stage per device: the same lists as 1F1B.
  spec = A.StageSpec(3, 3, 6)
  assert A.Interleaved1F1B(spec) == A.OneFOneB(spec)


def test_zero_bubble_exact_lists():
  spec = A.StageSpec(num_stages=2, num_devices=2, num_micro_batches=4)
  assert _Str(A.ZeroBubble(spec)) == [
      'F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 F0.3 I0.2 W0.2 I0.3 W0.3',
      'F1.0 I1.0 W1.0 F1.1 I1.1 W1.1 F1.2 I1.2 W1.2 F1.3 I1.3 W1.3',
  ]


def test_zbv_exact_lists():
  # Device d holds stages d and 2D - 1 - d; the turn of the V (stages 1 and
  # 2, then 3 and 0) stays on one device.
  spec = A.Placed('zbv', A.StageSpec(num_stages=4, num_devices=2,
                                     num_micro_batches=4))
  assert [spec.Device(s) for s in range(4)] == [0, 1, 1, 0]
  assert _Str(A.Build('zbv', spec)) == [
      'F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I3.1 W3.1 F0.3 I0.0 W0.0 F3.2 I3.2 '
      'W3.2 I0.1 W0.1 F3.3 I3.3 W3.3 I0.2 W0.2 I0.3 W0.3',
      'F1.0 F2.0 F1.1 F2.1 I2.0 W2.0 F1.2 I1.0 W1.0 F2.2 I2.1 W2.1 F1.3 I1.1 '
      'W1.1 F2.3 I2.2 W2.2 I1.2 I2.3 I1.3 W1.2 W2.3 W1.3',
  ]
  # One device, fewer micro-batches than the pipeline is deep; recompute:
  # each 'I' after its 'R'.
  spec = A.Placed('zbv', A.StageSpec(2, 1, 2, recompute=True))
  assert _Str(A.Build('zbv', spec)) == [
      'F0.0 F1.0 R1.0 I1.0 W1.0 F0.1 R0.0 I0.0 W0.0 F1.1 R1.1 I1.1 W1.1 '
      'R0.1 I0.1 W0.1']
  with pytest.raises(ValueError, match='zbv: 3 cells on 1 devices; it places '
                     'two cells on each device'):
    A.Build('zbv', A.StageSpec(3, 1, 2))
  with pytest.raises(ValueError, match='zbv: 2 cells on 2 devices'):
    A.Build('zbv', A.StageSpec(2, 2, 2))


@pytest.mark.parametrize('k,m', [(4, 4), (4, 8), (6, 6), (8, 8), (8, 16)])
def test_zbv_idles_less_than_1f1b(k, m):
  # The same K cells and M micro-batches: ZB-V on K / 2 devices idles less
  # than 1F1B on K devices or on K / 2 (folded), and holds at most 2D
  # micro-batch stages' activations per device (1F1B's first device: K).
  zbv = A.Placed('zbv', A.StageSpec(k, k // 2, m))
  tl = A.Simulate(zbv, A.Build('zbv', zbv))
  for d in (k, k // 2):
    spec = A.StageSpec(k, d, m)
    one = A.Simulate(spec, A.Build('1f1b', spec)).IdleFraction()
    assert tl.IdleFraction() < one, (d, tl.IdleFraction(), one)
  assert max(tl.PeakInFlight(d) for d in range(k // 2)) <= k


# (recompute, weight_gradient_run): none, whole backward passes, runs of 3.
_SPECS = [A.StageSpec(k, d, m, r, w)
          for k, d, m, (r, w) in itertools.product(
              (1, 2, 3, 4, 6), (1, 2, 3), (1, 2, 3, 4, 8, 12),
              ((False, 1), (True, 1), (True, 3)))
          if d <= k]


@pytest.mark.parametrize('name', sorted(A.ACTION_SCHEDULES))
def test_every_schedule_is_complete_placed_and_deadlock_free(name):
  built = 0
  for spec in _SPECS:
    spec = A.Placed(name, spec)
    try:
      schedule = A.ACTION_SCHEDULES[name](spec)
    except ValueError as e:
      # Only interleaved's and zbv's documented limits refuse a spec
      # (zero_bubble folds onto fewer devices).
      assert (name == 'interleaved_1f1b' and 'multiple' in str(e) or
              name == 'zbv' and 'two cells on each device' in str(e)), e
      continue
    A.CheckSchedule(spec, schedule)
    built += 1
  assert built >= 20


def test_check_schedule_finds_what_is_wrong():
  spec = A.StageSpec(2, 2, 2)
  good = A.OneFOneB(spec)
  with pytest.raises(ValueError, match='missing B1.1'):
    A.CheckSchedule(spec, [good[0], good[1][:-1]])
  with pytest.raises(ValueError, match='more than once: F0.0'):
    A.CheckSchedule(spec, [good[0] + [A.Action('F', 0, 0)], good[1]])
  with pytest.raises(ValueError, match='stage 1 runs on device 1'):
    A.CheckSchedule(spec, [good[0] + [A.Action('F', 1, 0)], good[1]])
  # Device 0 runs its backward before its forward reaches device 1.
  swapped = [[A.Action('B', 0, 0)] + [a for a in good[0]
                                      if a != A.Action('B', 0, 0)], good[1]]
  with pytest.raises(ValueError, match='deadlocks: device 0 at B0.0 waits '
                     'for F0.0, B1.0'):
    A.CheckSchedule(spec, swapped)


def test_bubbles_and_memory():
  # 1F1B holds K - d micro-batches, not M. GPipe's weight gradients, all
  # after its input gradients, fill part of its drain: less idle than 1F1B.
  spec = A.StageSpec(4, 4, 8)
  gpipe = A.Simulate(spec, A.GPipe(spec))
  one = A.Simulate(spec, A.OneFOneB(spec))
  assert gpipe.IdleFraction() < one.IdleFraction()
  assert [one.PeakInFlight(d) for d in range(4)] == [4, 3, 2, 1]
  assert [gpipe.PeakInFlight(d) for d in range(4)] == [8] * 4
  # (K - 1)(F + B) of idle per device over M(F + B) + (K - 1)(F + B).
  assert one.IdleFraction() == pytest.approx(3 / 11)
  # ZB-H1: less idle at 1F1B's activation memory.
  zb = A.Simulate(spec, A.ZeroBubble(spec))
  assert zb.IdleFraction() < one.IdleFraction() - 0.05
  assert [zb.PeakInFlight(d) for d in range(4)] == [4, 3, 2, 1]
  # Interleaving V = 2 virtual stages per device shrinks the bubble.
  v1 = A.StageSpec(2, 2, 4)
  v2 = A.StageSpec(4, 2, 4)
  il = A.Simulate(v2, A.Interleaved1F1B(v2),
                  cost=lambda a: A.UnitCost(a) / 2)  # Half a cell each.
  assert il.IdleFraction() < A.Simulate(v1, A.OneFOneB(v1)).IdleFraction()


def test_format_schedule():
  spec = A.StageSpec(2, 2, 2)
  text = A.FormatSchedule(spec, A.OneFOneB(spec))
  assert text.splitlines() == [
      'dev0 | F0.0 F0.1 .... .... B0.0 B0.0 .... B0.1 B0.1',
      'dev1 | .... F1.0 B1.0 B1.0 F1.1 B1.1 B1.1 .... ....',
      'idle 33.3% of 18 device-steps',
  ]


def test_build_refuses_bad_specs():
  with pytest.raises(ValueError, match="schedule='gpipe' has no action"):
    A.Build('gpipe', A.StageSpec(2, 2, 2))
  with pytest.raises(ValueError, match='num_micro_batches=3 must be a '
                     'multiple of the number of devices'):
    A.Build('interleaved_1f1b', A.StageSpec(4, 2, 3))
  with pytest.raises(ValueError, match='num_devices=3 > num_stages=2'):
    A.StageSpec(2, 3, 2)


def test_previous_on_device():
  spec = A.StageSpec(2, 2, 3)
  prev = A.PreviousOnDevice(A.OneFOneB(spec), ('B',))
  assert prev[A.Action('F', 0, 2)] == A.Action('B', 0, 0)
  assert prev[A.Action('F', 0, 1)] is None
  assert prev[A.Action('F', 1, 2)] == A.Action('B', 1, 1)


@pytest.mark.parametrize('name,spec', [
    ('zero_bubble', A.StageSpec(2, 2, 4)),
    ('zero_bubble', A.StageSpec(4, 4, 8)),
    ('interleaved_1f1b', A.StageSpec(4, 2, 4)),
    ('interleaved_1f1b', A.StageSpec(6, 3, 6))])
def test_forwards_first_keeps_each_kind_in_order_and_is_deadlock_free(
    name, spec):
  schedule = A.Build(name, spec)
  first = A.ForwardsFirst(schedule)
  A.CheckSchedule(spec, first)
  for acts, new in zip(schedule, first):
    n_fwd = sum(a.kind == 'F' for a in acts)
    assert all(a.kind == 'F' for a in new[:n_fwd])
    assert new[:n_fwd] == [a for a in acts if a.kind == 'F']
    assert new[n_fwd:] == [a for a in acts if a.kind != 'F']


@pytest.mark.parametrize('k,d,m', [(2, 1, 4), (4, 2, 4), (4, 2, 3), (3, 2, 5),
                                   (6, 4, 7)])
def test_zero_bubble_folds_onto_fewer_devices(k, d, m):
  spec = A.StageSpec(k, d, m)
  schedule = A.Build('zero_bubble', spec)  # Checked: complete, deadlock-free.
  one_each = A.ZeroBubble(A.StageSpec(k, k, m))
  for dev, acts in enumerate(schedule):
    assert all(spec.Device(a.stage) == dev for a in acts)
    # Each stage keeps its own order from the one-stage-per-device schedule.
    for s in spec.Stages(dev):
      assert [a for a in acts if a.stage == s] == one_each[s]


def test_1f1b_weight_gradients_in_runs_of_k():
  spec = A.StageSpec(num_stages=2, num_devices=2, num_micro_batches=5)
  assert _Str(A.Build('1f1b', spec)) == [
      'F0.0 F0.1 I0.0 F0.2 I0.1 W0.0 W0.1 F0.3 I0.2 F0.4 I0.3 W0.2 W0.3 '
      'I0.4 W0.4',
      'F1.0 I1.0 F1.1 I1.1 W1.0 W1.1 F1.2 I1.2 F1.3 I1.3 W1.2 W1.3 F1.4 '
      'I1.4 W1.4',
  ]
  # Group 1 is 1F1B with each backward split in place; recomputing, '1f1b'
  # keeps whole backward passes.
  assert _Str(A.GroupWeightGradients(A.OneFOneB(spec), 1))[1].startswith(
      'F1.0 I1.0 W1.0 F1.1 I1.1 W1.1')
  rc = A.StageSpec(2, 2, 5, recompute=True)
  assert A.Build('1f1b', rc) == A.OneFOneB(rc)
  with pytest.raises(ValueError, match='group=0 must be >= 1'):
    A.GroupWeightGradients(A.OneFOneB(spec), 0)
  # A stage's activations live until its run: K - s + K - 1 at most.
  tl = A.Simulate(A.StageSpec(4, 4, 8), A.Build('1f1b', A.StageSpec(4, 4, 8)))
  assert [tl.PeakInFlight(d) for d in range(4)] == [7, 6, 5, 4]


def test_1f1b_takes_longer_weight_gradient_runs_than_k():
  # Where the engine asks for runs longer than K (weights outweigh the
  # operands a run keeps), '1f1b' takes them: runs of 4 here, K = 2.
  spec = A.StageSpec(2, 2, 5, weight_gradient_run=4)
  assert _Str(A.Build('1f1b', spec)) == [
      'F0.0 F0.1 I0.0 F0.2 I0.1 F0.3 I0.2 F0.4 I0.3 W0.0 W0.1 W0.2 W0.3 '
      'I0.4 W0.4',
      'F1.0 I1.0 F1.1 I1.1 F1.2 I1.2 F1.3 I1.3 W1.0 W1.1 W1.2 W1.3 F1.4 '
      'I1.4 W1.4',
  ]
  # Shorter than K: runs of K still.
  assert A.Build('1f1b', A.StageSpec(2, 2, 5, weight_gradient_run=1)) == (
      A.Build('1f1b', A.StageSpec(2, 2, 5)))
  # Runs of M: one per stage; operands of every micro-batch alive until it.
  spec = A.StageSpec(4, 4, 8, weight_gradient_run=8)
  schedule = A.Build('1f1b', spec)
  assert [len(r) for r in A.WeightGradientRuns(schedule)] == [8] * 4
  tl = A.Simulate(spec, schedule)
  assert [tl.PeakInFlight(d) for d in range(4)] == [8] * 4
  # Recomputing, '1f1b' takes whole backward passes whatever the run.
  rc = A.StageSpec(2, 2, 5, recompute=True, weight_gradient_run=4)
  assert A.Build('1f1b', rc) == A.OneFOneB(rc)


def test_1f1b_with_more_stages_than_devices_folds():
  # 4 stages on 2 devices: the one-stage-per-device order, folded; each
  # stage keeps its K - s bound (not interleaved's constraints: M = 3).
  spec = A.StageSpec(num_stages=4, num_devices=2, num_micro_batches=3)
  schedule = A.OneFOneB(spec)
  A.CheckSchedule(spec, schedule)
  virtual = A.StageSpec(4, 4, 3)
  assert sorted(map(str, schedule[0])) == sorted(
      map(str, A.OneFOneB(virtual)[0] + A.OneFOneB(virtual)[2]))
  tl = A.Simulate(spec, schedule)
  for s in range(4):
    acts = schedule[s % 2]
    fwd = [a for a in acts if a.stage == s and a.kind == 'F']
    bwd = [a for a in acts if a.stage == s and a.kind == 'B']
    # At most 4 - s forward passes of stage s before its first backward.
    assert sum(tl.start[f] < tl.end[bwd[0]] for f in fwd) <= min(4 - s, 3)


def test_waits_cover_every_earlier_action():
  spec = A.StageSpec(2, 2, 4)
  schedule = A.Build('1f1b', spec)
  # '1f1b' enforces its forward passes: F0.2 waits for F0.1 and I0.0; F0.3
  # for everything since F0.2, the run W0.0-W0.1 included.
  waits = A.Waits(schedule, A.ORDERED_KINDS['1f1b'])
  assert ' '.join(map(str, waits[A.Action('F', 0, 2)])) == 'F0.1 I0.0'
  assert ' '.join(map(str, waits[A.Action('F', 0, 3)])) == (
      'F0.2 I0.1 W0.0 W0.1')
  assert set(waits) == {A.Action('F', s, t) for s in (0, 1) for t in range(4)}
  # Everything enforced: each waits for the one before it; within a run
  # of 'W's only the first waits.
  gpipe = A.Build('unrolled', spec)
  waits = A.Waits(gpipe, A.KINDS)
  assert waits[A.Action('W', 0, 0)] == [A.Action('I', 0, 3)]
  assert A.Action('W', 0, 1) not in waits
  assert waits[A.Action('F', 1, 0)] == []
  # 'unrolled' enforces none of its actions without recompute.
  assert A.Waits(gpipe, A.ORDERED_KINDS['unrolled']) == {}


def test_every_schedule_table_derives_from_the_records():
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  names = [r.name for r in records.RECORDS]
  assert records.NAMES == tuple(names) and len(set(names)) == len(names)
  assert set(A.ACTION_SCHEDULES) == set(names) - {'recurrent'}
  assert A.ORDERED_KINDS['unrolled'] == (A.Kind.R,)
  assert A.ORDERED_KINDS['1f1b'] == ('F', 'R')  # A Kind equals its letter.
  assert records.ALWAYS_RECOMPUTE == ('recurrent',)
  assert records.LINEAR_LOSS_ONLY == ('interleaved_1f1b', 'zero_bubble',
                                      'zbv')
  assert A.SIZED_WEIGHT_GRADIENT_RUNS == {('unrolled', True), ('1f1b', False)}
  help_text = records.ScheduleHelp()
  assert all("'%s'" % n in help_text for n in names)
  # What the planner enumerates.
  choices = {r.name: (r.RecomputeChoices(True), r.RecomputeChoices(False))
             for r in records.RECORDS}
  assert choices['recurrent'] == ((True,), (True,))
  assert choices['1f1b'] == ((False, True), (True,))
  assert choices['zbv'] == ((False,), (False,))
  assert records.Get('recurrent').planner.simulated_as == 'unrolled'
  assert records.RecomputeError('recurrent', False, 'task.').startswith(
      "task.recompute=False, but task.schedule='recurrent' always")
  assert records.RecomputeError('1f1b', False, '') is None
  with pytest.raises(ValueError, match=r"schedule='gpipe'; use one of"):
    records.Get('gpipe')


# lingvo_ext/pipeline/'s modules, lower layers first (its __init__): the cut,
# then the engine, then the public face.
_CUT_LAYERS = ('nest_util', 'partitioning', 'cuts', 'cut_checkpoints', 'cost',
               'cells')
_ENGINE_LAYERS = ('kinds', 'runs', 'simulate', 'transforms', 'text',
                  'generators', 'records', 'tensors', 'graph_state',
                  'jit_random', 'matmul_grad', 'gemm_rewrite',
                  'cell_function', 'randomness', 'custom_gradient',
                  'weight_gradients', 'loss', 'interpreter', 'recurrent')
_TF_FREE = _ENGINE_LAYERS[:_ENGINE_LAYERS.index('records') + 1]
_PIPELINE_LAYERS = _CUT_LAYERS + _ENGINE_LAYERS + ('schedules',)


def test_engine_modules_import_only_lower_layers():
  import ast  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(A.__file__)
  files = {f[:-3] for f in os.listdir(root)
           if f.endswith('.py') and f != '__init__.py'}
  assert files == set(_PIPELINE_LAYERS)
  for name in _PIPELINE_LAYERS:
    with open(os.path.join(root, name + '.py')) as f:
      tree = ast.parse(f.read())
    lines = sum(1 for _ in open(os.path.join(root, name + '.py')))
    assert lines <= 500, (name, lines)
    imported = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        imported.add(node.module + ''.join(
            '.' + a.name for a in node.names
            if node.module == 'lingvo_ext.pipeline'))
      elif isinstance(node, ast.Import):
        imported |= {a.name for a in node.names}
    below = _PIPELINE_LAYERS[:_PIPELINE_LAYERS.index(name)]
    for module in imported:
      if module.startswith('lingvo_ext.pipeline.'):
        assert module.split('.')[2] in below, (name, module)
      # Nothing in the engine imports the modules that re-export it.
      assert module not in ('lingvo_ext.pipeline.schedules',
                            'lingvo_ext.core.gpipe') or name == 'schedules', (
                                name, module)
    if name in _TF_FREE:
      assert not any('lingvo' in m and 'lingvo_ext' not in m or
                     'tensorflow' in m for m in imported), (name, imported)
