"""The planner's predictions (prediction.py): bubbles, memory, overheads."""

import dataclasses
import math
import os

import pytest

from lingvo_ext import planner
from lingvo_ext.pipeline import schedules
from tests.support import planner_testlib as lib


@pytest.mark.parametrize('k,m', [(2, 1), (2, 4), (4, 4), (4, 8), (3, 16)])
def test_gpipe_bubble(k, m):
  # Whole backward passes: GPipe's (K - 1) / (M + K - 1).
  spec = schedules.StageSpec(k, k, m, recompute=True)
  no_r = lambda a: 0. if a.kind == 'R' else schedules.UnitCost(a)
  tl = schedules.Simulate(spec, schedules.Build('unrolled', spec), no_r)
  assert tl.IdleFraction() == pytest.approx((k - 1) / (m + k - 1))
  # 'unrolled' runs the input gradients first and the weight gradients
  # after them (F = I = W = 1): the weight gradients fill part of the
  # drain, (K - 1)(F + I) idle per device over M(F + I + W) + (K - 1)(F + I).
  spec = schedules.StageSpec(k, k, m)
  tl = schedules.Simulate(spec, schedules.Build('unrolled', spec),
                        schedules.UnitCost)
  split = 2 * (k - 1) / (3 * m + 2 * (k - 1))
  assert tl.IdleFraction() == pytest.approx(split)
  # The planner's own simulation (equal stages, compute only) agrees.
  profile = lib.Profile(num_layers=k * 2, batch=16 * 3)
  plan = planner.Predict(profile, lib.Plan(k, m, profile=profile),
                         lib.FLOPS_ONLY)
  assert plan.bubble == pytest.approx(split)


@pytest.mark.parametrize('schedule', ['unrolled', '1f1b', 'zero_bubble'])
def test_more_micro_batches_smaller_bubble(schedule):
  profile = lib.Profile()
  bubbles = [planner.Predict(profile, lib.Plan(4, m, schedule), lib.FLOPS_ONLY
                            ).bubble for m in (1, 2, 4, 8, 16)]
  assert all(b < a for a, b in zip(bubbles, bubbles[1:])), bubbles


def test_more_micro_batches_faster_when_compute_bound():
  profile = lib.Profile()
  times = [planner.Predict(profile, lib.Plan(4, m), lib.FLOPS_ONLY).step_s
           for m in (1, 2, 4, 8)]
  assert all(b < a for a, b in zip(times, times[1:])), times
  # Step = M (F + B) + (K - 1)(F + I) of one micro-batch stage (F = 2e6
  # FLOPs per example per stage, B = 2F, I = F): see test_gpipe_bubble.
  mb = 32 // 8
  assert times[-1] == pytest.approx((8 * 3 + 3 * 2) * 2e6 * mb / 1e9)


def test_ungated_actions_share_the_host_cores():
  """'unrolled' holds no action to its list: on a host of 2 cores one cell
  computes its two micro-batches at once (bench/plan.py, FC model: one cell
  at M=2 stepped 1.41x faster than at M=1, and the plan with one cell
  predicted flat in M was chosen at 1.40x the best). One core, devices that
  are processors of their own (cores=None), or a schedule that gates its
  actions, leave a device one action at a time."""
  profile = lib.Profile()

  def Step(m, schedule='unrolled', cores=2.):
    return planner.Predict(profile, lib.Plan(1, m, schedule),
                           lib.Machine(cores=cores)).step_s

  one = Step(1)
  # M=2 of 16 examples: F and I of one micro-batch, then the run of both
  # W's (4 units of 16) against F, I and W of 32 (3 units of 32).
  assert Step(2) == pytest.approx(one * 2 / 3)
  assert Step(2, cores=1.) == pytest.approx(one)
  assert Step(2, cores=None) == pytest.approx(one)
  assert Step(2, '1f1b') == pytest.approx(Step(1, '1f1b'))
  # More micro-batches: the 2 cores' share of the work bounds it.
  assert Step(8) == pytest.approx(one / 2)


@pytest.mark.parametrize('schedule,m', [('unrolled', 8), ('1f1b', 8),
                                        ('unrolled', 2), ('unrolled', 1)])
def test_recompute_uses_less_memory_and_more_time(schedule, m):
  profile = lib.Profile(kept=4096.)
  plain = planner.Predict(profile, lib.Plan(2, m, schedule), lib.FLOPS_ONLY)
  rc = planner.Predict(profile, lib.Plan(2, m, schedule, recompute=True),
                       lib.FLOPS_ONLY)
  if m == 1:  # One micro-batch: its activations are alive either way.
    assert rc.peak_bytes == plain.peak_bytes
  else:
    assert rc.peak_bytes < plain.peak_bytes
  assert rc.step_s > plain.step_s


def test_memory_parts():
  """Weights x (1 + gradient + 2 Adam slots) + in-flight activations."""
  profile = lib.Profile(num_layers=2, batch=8, kept=100., out=10.)
  plan = planner.Predict(profile, lib.Plan(1, 2, profile=profile),
                         lib.FLOPS_ONLY)
  weights = 2 * 4096 * 4
  # GPipe on one stage: both micro-batches alive (4 examples x 2 layers x
  # 100 bytes each); the batch's input (256 B each) and the output and its
  # gradient (10 B each).
  acts = 2 * 4 * 2 * 100 + 8 * 256 + 2 * 8 * 10
  assert plan.peak_bytes == pytest.approx(weights + acts)


def test_one_f_one_b_holds_fewer_micro_batches_than_gpipe():
  profile = lib.Profile(kept=4096.)
  gpipe = planner.Predict(profile, lib.Plan(4, 16), lib.FLOPS_ONLY)
  ofob = planner.Predict(profile, lib.Plan(4, 16, '1f1b'), lib.FLOPS_ONLY)
  assert ofob.peak_bytes < gpipe.peak_bytes


def test_replicas_share_cores():
  """Two replicas on a host of one core take twice one replica's compute."""
  profile = lib.Profile()
  one_core = planner.Machine(flops_per_s=1e9, s_per_op=0., step_s=0.,
                             bytes_per_s=1e30, update_ops_per_var=0, cores=1)
  one = planner.Predict(profile, lib.Plan(1, 1), one_core)
  two = planner.Predict(profile, lib.Plan(1, 1, replicas=2), one_core)
  assert two.step_s == pytest.approx(one.step_s)  # Half the batch each.
  free = planner.Predict(profile, lib.Plan(1, 1, replicas=2), lib.FLOPS_ONLY)
  assert free.step_s == pytest.approx(one.step_s / 2)


def test_bytes_between_devices():
  profile = lib.Profile(out=100.)
  plan = planner.Predict(profile, lib.Plan(2, 4), lib.FLOPS_ONLY)
  # One boundary: activations forward, gradients back, for 32 examples.
  assert plan.comm_bytes == 2 * 100 * 32
  one_cell = planner.Predict(profile, lib.Plan(1, 4), lib.FLOPS_ONLY)
  assert one_cell.comm_bytes == 0


def test_handoff_bytes_only_across_devices():
  profile = lib.Profile(out=100.)
  stages = planner.Stages(profile, (2, 2, 2, 2))
  folded = schedules.StageSpec(4, 2, 4)  # Stage s on device s % 2.
  one = schedules.StageSpec(4, 1, 4)
  a = schedules.Action
  # A forward pass receives its input (100 B per example, 8 examples), a
  # backward pass its output's gradient; never the first cell's forward or
  # the last cell's backward, nor anything on one device.
  assert planner.HandoffBytes(stages, folded, a('F', 1, 0), 8) == 800.
  assert planner.HandoffBytes(stages, folded, a('I', 0, 0), 8) == 800.
  assert planner.HandoffBytes(stages, folded, a('B', 2, 3), 8) == 800.
  assert planner.HandoffBytes(stages, folded, a('F', 0, 0), 8) is None
  assert planner.HandoffBytes(stages, folded, a('B', 3, 0), 8) is None
  assert planner.HandoffBytes(stages, folded, a('W', 1, 0), 8) is None
  assert planner.HandoffBytes(stages, folded, a('R', 1, 0), 8) is None
  assert all(planner.HandoffBytes(stages, one, a(k, s, 0), 8) is None
             for k in 'FB' for s in range(4))


def test_handoffs_priced_on_the_critical_path():
  """K = 2, M = 1 with whole backward passes (recompute) runs F0 F1 R1 B1 R0
  B0 in turn: F1 and B0 each wait for one hand-off of 32 examples x 100 B."""
  profile = lib.Profile(out=100.)
  machine = lib.Machine(s_per_handoff=1e-3, bytes_per_s=3.2e6)
  plan = lambda k: lib.Plan(k, 1, 'unrolled', True, profile=profile)
  two = planner.Predict(profile, plan(2), machine)
  # One cell does the same work in the same order and hands nothing over.
  one = planner.Predict(profile, plan(1), machine)
  assert two.step_s - one.step_s == pytest.approx(2 * (1e-3 + 1e-3))
  free = planner.Predict(profile, plan(2),
                         dataclasses.replace(machine, s_per_handoff=0.,
                                             bytes_per_s=1e30))
  assert free.step_s == pytest.approx(planner.Predict(
      profile, plan(1), dataclasses.replace(machine, bytes_per_s=1e30)).step_s)


@pytest.mark.parametrize('schedule,recompute,kinds', [
    ('unrolled', False, ('R',)), ('unrolled', True, ('R',)),
    ('recurrent', True, ()),
    ('1f1b', False, ('F', 'R')), ('1f1b', True, ('F', 'R')),
    ('zero_bubble', False, schedules.KINDS),
    ('interleaved_1f1b', False, schedules.KINDS)])
def test_gated_kinds(schedule, recompute, kinds):
  k = 4 if schedule == 'interleaved_1f1b' else 2
  plan = lib.Plan(k, 4, schedule, recompute, devices=2)
  assert planner.GatedKinds(plan) == kinds
  # A gate costs only where the engine gates: on one core (the step is all
  # the work) each gated action adds one gate.
  one_core = dict(cores=1)
  base = planner.Predict(lib.Profile(), plan, lib.Machine(**one_core)).step_s
  gated = planner.Predict(lib.Profile(), dataclasses.replace(plan),
                          lib.Machine(s_per_gate=1e-3, **one_core)).step_s
  spec, schedule_lists = planner.ActionSchedule(plan)
  n = sum(a.kind in kinds for acts in schedule_lists for a in acts)
  assert gated - base == pytest.approx(n * 1e-3)
  # Per (cell, micro-batch): F and B, or F, I and W; '1f1b' F (and R).
  per = {'zero_bubble': 3, 'interleaved_1f1b': 2, '1f1b': 1 + recompute,
         'unrolled': int(recompute)}.get(schedule, 0)
  assert n == k * 4 * per


@pytest.mark.parametrize('schedule,k,m,recompute,sums', [
    ('unrolled', 2, 8, False, 0), ('unrolled', 2, 8, True, 7),
    ('1f1b', 2, 8, False, 3), ('1f1b', 4, 8, True, 7), ('1f1b', 4, 2, True, 1),
    ('1f1b', 3, 8, False, 2), ('1f1b', 4, 2, False, 0),
    ('zero_bubble', 2, 8, False, 7), ('zero_bubble', 4, 4, False, 3),
    ('recurrent', 2, 8, True, 8), ('recurrent', 1, 4, True, 3),
    ('recurrent', 1, 1, True, 0)])
def test_gradient_sums_per_engine(schedule, k, m, recompute, sums):
  plan = lib.Plan(k, m, schedule, recompute,
                  devices=2 if schedule == 'zero_bubble' and k == 4 else None)
  assert planner.Accumulations(plan) == sums
  # Priced: each sum reads two and writes one of the stage's weight bytes
  # (on one core the step is all the work). 'recurrent' sums each loop
  # step's gradients after the first.
  profile = lib.Profile(param_bytes=1000)
  one_core = dict(cores=1)
  base = planner.Predict(profile, plan, lib.Machine(**one_core)).step_s
  priced = planner.Predict(profile, dataclasses.replace(plan), lib.Machine(
      add_bytes_per_s=1e6, s_per_op=0., **one_core)).step_s
  # 8 layers of 1000 B over the K cells, summed `sums` times each.
  assert priced - base == pytest.approx(sums * 3 * 8000 / 1e6)


@pytest.mark.parametrize('schedule,param_bytes,run,group', [
    ('unrolled', 1000, 1, 1), ('unrolled', 4096, 3, 3),
    ('unrolled', 100000, 8, 8), ('1f1b', 1000, 1, 2), ('1f1b', 4096, 3, 3),
    ('1f1b', 100000, 8, 8)])
def test_weight_gradient_runs_and_their_sums(schedule, param_bytes, run,
                                             group):
  profile = lib.Profile(param_bytes=param_bytes)
  plan = lib.Plan(2, 8, schedule, schedule == 'unrolled', profile=profile)
  assert planner.WeightGradientRun(
      plan, planner.Stages(profile, plan.sizes)) == run
  sums = -(-8 // group) - 1
  assert planner.Accumulations(plan, run) == sums
  one_core = dict(cores=1)
  base = planner.Predict(profile, plan, lib.Machine(**one_core))
  priced = planner.Predict(profile, dataclasses.replace(plan), lib.Machine(
      add_bytes_per_s=1e6, s_per_op=0., **one_core))
  assert priced.step_s - base.step_s == pytest.approx(
      sums * 3 * 8 * param_bytes / 1e6)
  # A run's micro-batches are alive together until it, as memory counts
  # them (PeakInFlight): r recomputed micro-batches per device for
  # 'unrolled'; 1F1B's K - d in flight and a run's group - 1 before it.
  spec, lists = planner.ActionSchedule(plan, True, run)
  assert spec.weight_gradient_run == run
  timeline = schedules.Simulate(spec, lists)
  want = ([run, run] if schedule == 'unrolled' else
          [min(8, 2 - d + group - 1) for d in range(2)])
  assert [timeline.PeakInFlight(d) for d in range(2)] == want


def test_recurrent_runs_every_cell_at_every_loop_step():
  """Lingvo's StackedRecurrent: M + K - 1 steps, each runs all cells (the
  bubble's on padding) and each backward step recomputes: K = 2, M = 4 is 5
  steps of one cell's F + R + B, and 5 x 2 cells' work on one core."""
  profile = lib.Profile()
  plan = planner.Predict(profile, lib.Plan(2, 4, 'recurrent', True),
                         lib.Machine())
  cell = 4 * 1e6 * 8 / 1e9  # 4 layers of 1e6 FLOPs, 8 examples.
  assert plan.step_s == pytest.approx(5 * cell * (1 + 1 + 2))
  assert plan.bubble == pytest.approx(1 / 5.)
  one_core = planner.Predict(profile, lib.Plan(2, 4, 'recurrent', True),
                             lib.Machine(cores=1))
  assert one_core.step_s == pytest.approx(2 * 5 * cell * 4)
  # GPipe's order with recompute skips the bubble's work: on one core it is
  # 4 micro-batches' work, not 5.
  unrolled = planner.Predict(profile, lib.Plan(2, 4, 'unrolled', True),
                             lib.Machine(cores=1))
  assert unrolled.step_s == pytest.approx(2 * 4 * cell * 4)


def test_zero_bubble_folds_cells_onto_fewer_devices():
  profile = lib.Profile()
  plans = planner.Enumerate(profile, 2)
  folded = [p for p in plans if p.schedule == 'zero_bubble' and
            p.num_cells > p.devices_per_replica]
  # Two cells per device (more would cost the enumeration more than the
  # sweep is worth).
  assert {(p.num_cells, p.devices_per_replica) for p in folded} == {(4, 2)}
  assert {(p.num_cells, p.devices_per_replica) for p in planner.Enumerate(
      profile, 3) if p.schedule == 'zero_bubble'} == {
          (2, 2), (4, 2), (3, 3), (6, 3)}
  plan = next(p for p in folded if p.num_cells == 4 and
              p.num_micro_batches == 4)
  assert plan.Key() == 'K4/D2xR1 M4 zero_bubble'
  assert planner.TrainerFlags(plan) == ['--num_cpu_devices=2',
                                        '--worker_split_size=2']
  assert planner.Overrides(plan)['task.num_partitions'] == 4
  # Simulated on 2 devices as the engine folds it (schedules.FoldOntoDevices):
  # less idle than one cell per device at the same M.
  flat = planner.Predict(profile, lib.Plan(2, 4, 'zero_bubble'), lib.FLOPS_ONLY)
  four = planner.Predict(profile, plan, lib.FLOPS_ONLY)
  spec, lists = planner.ActionSchedule(plan)
  assert spec.num_devices == 2 and len(lists) == 2
  assert four.bubble < flat.bubble


def test_probe_prices_handoffs_and_gradient_sums():
  """The probe prices every field, each within the bounds that hold under
  any load (a busy host slows the timed chains; it never makes them free)."""
  machine = planner.ProbeMachine()
  for name in ('flops_per_s', 's_per_op', 'add_bytes_per_s'):
    value = getattr(machine, name)
    assert 0 < value < math.inf, (name, machine)
  for name in ('step_s', 's_per_handoff', 's_per_gate'):
    value = getattr(machine, name)
    assert 0 <= value < math.inf, (name, machine)
  assert 1 <= machine.cores <= (os.cpu_count() or 1), machine
  assert machine.overhead_bytes == 0, machine


def test_all_reduce_pays_its_collectives_per_variable_and_replica():
  """Bytes free: 'shared' adds no op per variable (tf.gradients sums the
  replicas' gradients in the backward pass), 'all_reduce' its collectives'
  SYNC_OPS_PER_VAR per variable and replica."""
  profile = lib.Profile()
  num_vars = sum(l.num_vars for l in profile.layers)
  machine = lib.Machine(s_per_op=1e-6)
  reduce = lib.Plan(1, 1, replicas=2)
  assert reduce.gradient_sync == 'all_reduce'
  shared = dataclasses.replace(reduce, gradient_sync='shared')
  gap = (planner.Predict(profile, reduce, machine).step_s -
         planner.Predict(profile, shared, machine).step_s)
  assert planner.SYNC_OPS_PER_VAR == {'shared': 0, 'all_reduce': 6}
  assert gap == pytest.approx(6 * num_vars * 2 * 1e-6)


def test_recurrent_pays_per_step_after_the_first():
  """Lingvo's loop: each step after the first costs recurrent_s_per_byte
  per byte of the cell's weights, on its device: M = 4 on one cell pays 3
  steps of all 8 x 4096 B; K = 2, M = 1 pays one step of each cell's half,
  the two cells side by side."""
  profile = lib.Profile()
  per_byte = dict(recurrent_s_per_byte=1e-6)
  for k, m, paid in ((1, 4, 3 * 8 * 4096), (2, 1, 1 * 4 * 4096),
                     (1, 1, 0)):
    base = planner.Predict(profile, lib.Plan(k, m, 'recurrent', True),
                           lib.Machine()).step_s
    more = planner.Predict(profile, lib.Plan(k, m, 'recurrent', True),
                           lib.Machine(**per_byte)).step_s
    assert more - base == pytest.approx(paid * 1e-6), (k, m)
  # Not for the other schedules.
  plan = lib.Plan(2, 4)
  assert planner.Predict(profile, plan, lib.Machine(**per_byte)).step_s == (
      pytest.approx(planner.Predict(profile, dataclasses.replace(plan),
                                    lib.Machine()).step_s))


def test_the_loop_is_a_record_fact():
  """The planner prices Lingvo's loop by its record's fact, not its name."""
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  loops = [r.name for r in records.RECORDS if r.planner.lingvo_loop]
  assert loops == [records.LINGVO_ENGINE]
  assert all((r.generator is None) == r.planner.lingvo_loop
             for r in records.RECORDS)
