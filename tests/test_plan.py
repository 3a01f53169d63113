"""The automatic plan (issue 24): lingvo_ext/planner/, tools/plan.py."""

import dataclasses
import json
import math
import os
import sys

import pytest

from lingvo_ext.core import actions
from lingvo_ext.core import partitioning
from lingvo_ext import planner
from tests.support import zygote
from tests.support import ROOT

TINY = 'lm.TransformerLmTiny'


def _Layer(name, flops=1e6, param_bytes=4096, kept=512., out=256.):
  return planner.LayerProfile(
      name=name, flops=flops, fwd_ops=4, bwd_ops=9, param_bytes=param_bytes,
      num_vars=2, out_bytes=out, kept_bytes=kept)


def _Profile(num_layers=8, batch=32, linear_loss=True, **kwargs):
  return planner.ModelProfile(
      name='toy', layers=tuple(_Layer('l%d' % i, **kwargs)
                               for i in range(num_layers)),
      batch=batch, in_bytes=256., optimizer_slots=2, linear_loss=linear_loss)


# Compute only: FLOPs at 1e9/s, nothing per op or per step.
_FLOPS_ONLY = planner.Machine(flops_per_s=1e9, s_per_op=0., step_s=0.,
                              bytes_per_s=1e30, update_ops_per_var=0)


def _Plan(k, m, schedule='unrolled', recompute=False, replicas=1,
          profile=None, devices=None):
  profile = profile or _Profile()
  sizes = partitioning.MinMaxPartition([l.flops for l in profile.layers], k)
  return planner.Plan(
      num_cells=k, sizes=tuple(sizes), devices_per_replica=devices or k,
      num_micro_batches=m, schedule=schedule, recompute=recompute,
      replicas=replicas, gradient_sync='all_reduce' if replicas > 1 else
      'shared', global_batch=profile.batch)


# --- Enumeration --------------------------------------------------------------


@pytest.mark.parametrize('devices', [1, 2, 3, 4, 8])
def test_enumeration_respects_devices(devices):
  plans = planner.Enumerate(_Profile(), devices)
  assert plans
  for p in plans:
    assert p.devices_per_replica * p.replicas <= devices
    if p.num_cells == p.devices_per_replica:
      assert p.num_cells * p.replicas <= devices
    else:  # Several cells per device: only these schedules fold them.
      assert p.schedule in ('interleaved_1f1b', 'zero_bubble', 'zbv')
      assert p.num_cells % p.devices_per_replica == 0
      assert p.num_cells > p.devices_per_replica
    assert sum(p.sizes) == 8 and len(p.sizes) == p.num_cells
    assert (p.global_batch // p.replicas) % p.num_micro_batches == 0
  # Every K * R <= N is offered (K = D), and nothing more.
  kr = {(p.num_cells, p.replicas) for p in plans
        if p.num_cells == p.devices_per_replica}
  assert kr == {(k, r) for k in range(1, devices + 1)
                for r in range(1, devices // k + 1) if 32 % r == 0}


def test_enumeration_uses_the_exact_cut():
  profile = planner.ModelProfile(
      name='uneven', batch=8, in_bytes=4.,
      layers=tuple(_Layer('l%d' % i, flops=f)
                   for i, f in enumerate([1, 1, 1, 6, 1, 1, 1, 1])))
  plans = planner.Enumerate(profile, 2)
  cuts = {p.num_cells: p.sizes for p in plans}
  # The exact min-max cut: {1,1,1,6 | 1,1,1,1} has a bottleneck of 9, the
  # least possible.
  assert cuts[2] == (4, 4)
  assert cuts[1] == (8,)


def test_enumeration_offers_schedules_the_loss_allows():
  nonlinear = {(p.schedule, p.recompute)
               for p in planner.Enumerate(_Profile(linear_loss=False), 4)}
  # No backward pass before every forward: '1f1b' recomputes.
  assert ('1f1b', False) not in nonlinear and ('1f1b', True) in nonlinear
  assert ('recurrent', False) not in nonlinear
  assert {('zero_bubble', False), ('interleaved_1f1b', False),
          ('unrolled', True), ('unrolled', False)} <= nonlinear
  linear = {(p.schedule, p.recompute)
            for p in planner.Enumerate(_Profile(), 4)}
  assert {('zero_bubble', False), ('interleaved_1f1b', False),
          ('1f1b', False), ('unrolled', True)} <= linear


def test_nonlinear_loss_runs_forwards_first():
  """zero_bubble with a loss not linear in the outputs: all forwards first,
  so every micro-batch is alive at once, as under GPipe."""
  plan = _Plan(4, 8, 'zero_bubble')
  linear = planner.Predict(_Profile(kept=4096.), plan, _FLOPS_ONLY)
  nonlinear = planner.Predict(_Profile(kept=4096., linear_loss=False),
                              dataclasses.replace(plan), _FLOPS_ONLY)
  gpipe = planner.Predict(_Profile(kept=4096., linear_loss=False),
                          _Plan(4, 8), _FLOPS_ONLY)
  assert nonlinear.peak_bytes == gpipe.peak_bytes > linear.peak_bytes


def test_budget_drops_plans_and_names_the_least_that_fits():
  profile = _Profile()
  plans = planner.PredictAll(profile, planner.Enumerate(profile, 4),
                             _FLOPS_ONLY)
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
  profile = _Profile()
  plans = planner.Rank(planner.PredictAll(
      profile, planner.Enumerate(profile, 4), _FLOPS_ONLY))
  times = [p.step_s for p in plans]
  # Within the 0.5% tie band, the order is by time.
  assert all(b >= a * 0.995 for a, b in zip(times, times[1:]))


# --- Predictions --------------------------------------------------------------


@pytest.mark.parametrize('k,m', [(2, 1), (2, 4), (4, 4), (4, 8), (3, 16)])
def test_gpipe_bubble(k, m):
  # Whole backward passes: GPipe's (K - 1) / (M + K - 1).
  spec = actions.StageSpec(k, k, m, recompute=True)
  no_r = lambda a: 0. if a.kind == 'R' else actions.UnitCost(a)
  tl = actions.Simulate(spec, actions.Build('unrolled', spec), no_r)
  assert tl.IdleFraction() == pytest.approx((k - 1) / (m + k - 1))
  # 'unrolled' runs the input gradients first and the weight gradients
  # after them (F = I = W = 1): the weight gradients fill part of the
  # drain, (K - 1)(F + I) idle per device over M(F + I + W) + (K - 1)(F + I).
  spec = actions.StageSpec(k, k, m)
  tl = actions.Simulate(spec, actions.Build('unrolled', spec),
                        actions.UnitCost)
  split = 2 * (k - 1) / (3 * m + 2 * (k - 1))
  assert tl.IdleFraction() == pytest.approx(split)
  # The planner's own simulation (equal stages, compute only) agrees.
  profile = _Profile(num_layers=k * 2, batch=16 * 3)
  plan = planner.Predict(profile, _Plan(k, m, profile=profile), _FLOPS_ONLY)
  assert plan.bubble == pytest.approx(split)


@pytest.mark.parametrize('schedule', ['unrolled', '1f1b', 'zero_bubble'])
def test_more_micro_batches_smaller_bubble(schedule):
  profile = _Profile()
  bubbles = [planner.Predict(profile, _Plan(4, m, schedule), _FLOPS_ONLY
                            ).bubble for m in (1, 2, 4, 8, 16)]
  assert all(b < a for a, b in zip(bubbles, bubbles[1:])), bubbles


def test_more_micro_batches_faster_when_compute_bound():
  profile = _Profile()
  times = [planner.Predict(profile, _Plan(4, m), _FLOPS_ONLY).step_s
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
  profile = _Profile()

  def Step(m, schedule='unrolled', cores=2.):
    return planner.Predict(profile, _Plan(1, m, schedule),
                           _Machine(cores=cores)).step_s

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
  profile = _Profile(kept=4096.)
  plain = planner.Predict(profile, _Plan(2, m, schedule), _FLOPS_ONLY)
  rc = planner.Predict(profile, _Plan(2, m, schedule, recompute=True),
                       _FLOPS_ONLY)
  if m == 1:  # One micro-batch: its activations are alive either way.
    assert rc.peak_bytes == plain.peak_bytes
  else:
    assert rc.peak_bytes < plain.peak_bytes
  assert rc.step_s > plain.step_s


def test_memory_parts():
  """Weights x (1 + gradient + 2 Adam slots) + in-flight activations."""
  profile = _Profile(num_layers=2, batch=8, kept=100., out=10.)
  plan = planner.Predict(profile, _Plan(1, 2, profile=profile), _FLOPS_ONLY)
  weights = 2 * 4096 * 4
  # GPipe on one stage: both micro-batches alive (4 examples x 2 layers x
  # 100 bytes each); the batch's input (256 B each) and the output and its
  # gradient (10 B each).
  acts = 2 * 4 * 2 * 100 + 8 * 256 + 2 * 8 * 10
  assert plan.peak_bytes == pytest.approx(weights + acts)


def test_one_f_one_b_holds_fewer_micro_batches_than_gpipe():
  profile = _Profile(kept=4096.)
  gpipe = planner.Predict(profile, _Plan(4, 16), _FLOPS_ONLY)
  ofob = planner.Predict(profile, _Plan(4, 16, '1f1b'), _FLOPS_ONLY)
  assert ofob.peak_bytes < gpipe.peak_bytes


def test_replicas_share_cores():
  """Two replicas on a host of one core take twice one replica's compute."""
  profile = _Profile()
  one_core = planner.Machine(flops_per_s=1e9, s_per_op=0., step_s=0.,
                             bytes_per_s=1e30, update_ops_per_var=0, cores=1)
  one = planner.Predict(profile, _Plan(1, 1), one_core)
  two = planner.Predict(profile, _Plan(1, 1, replicas=2), one_core)
  assert two.step_s == pytest.approx(one.step_s)  # Half the batch each.
  free = planner.Predict(profile, _Plan(1, 1, replicas=2), _FLOPS_ONLY)
  assert free.step_s == pytest.approx(one.step_s / 2)


def test_bytes_between_devices():
  profile = _Profile(out=100.)
  plan = planner.Predict(profile, _Plan(2, 4), _FLOPS_ONLY)
  # One boundary: activations forward, gradients back, for 32 examples.
  assert plan.comm_bytes == 2 * 100 * 32
  assert planner.Predict(profile, _Plan(1, 4), _FLOPS_ONLY).comm_bytes == 0


@pytest.mark.parametrize('cell_functions', [False, True])
def test_calibrate_recovers_the_constants(cell_functions):
  profile = dataclasses.replace(_Profile(linear_loss=False),
                                cell_functions=cell_functions)
  truth = planner.Machine(flops_per_s=1e9, s_per_op=3e-5, step_s=4e-3,
                          recurrent_op_factor=0.4, recurrent_s_per_byte=2e-9,
                          bytes_per_op=2048., overhead_bytes=5e8, cores=2,
                          s_per_reduced_var=9e-5)
  refs = planner.ReferencePlans(profile, devices=2)
  assert [(p.replicas, p.gradient_sync) for p in refs] == [
      (1, 'shared')] * 4 + [(2, 'all_reduce')]
  assert len(planner.ReferencePlans(profile, devices=1)) == 4
  times = [planner.Predict(profile, p, truth).step_s for p in refs]
  rss = [planner.Predict(profile, p, truth).process_bytes for p in refs]
  probed = planner.Machine(flops_per_s=1e9, s_per_op=1e-6, cores=2)
  fitted = planner.Calibrate(profile, probed, times, rss)
  fields = ['s_per_op', 'step_s', 'recurrent_op_factor',
            'recurrent_s_per_byte', 's_per_reduced_var']
  if not cell_functions:  # The graph grows with M: its bytes per op fit.
    fields += ['bytes_per_op', 'overhead_bytes']
  for field in fields:
    assert getattr(fitted, field) == pytest.approx(getattr(truth, field)), (
        field)
  if cell_functions:
    # Cells built once: the references' graphs differ by a few calls, so
    # the bytes per op are the default, and the overhead makes the first
    # reference's predicted process peak its measured one.
    assert fitted.bytes_per_op == planner.DEFAULT_BYTES_PER_OP
    assert planner.Predict(profile, refs[0], fitted).process_bytes == (
        pytest.approx(rss[0]))
  # Without the fifth reference, all_reduce's time per variable stays
  # SYNC_OPS_PER_VAR ops.
  assert planner.Calibrate(profile, probed, times[:4]).s_per_reduced_var is None


def test_spearman():
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  assert bench_plan.Spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
  assert bench_plan.Spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
  assert bench_plan.Spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


@pytest.mark.parametrize('text,size', [('512MB', 512 * 2**20), ('2G', 2**31),
                                       ('1.5GiB', int(1.5 * 2**30)),
                                       ('300000', 300000), ('64 kb', 65536)])
def test_parse_size(text, size):
  assert planner.ParseSize(text) == size


@pytest.mark.parametrize('text', ['2XB', 'MB', '-1GB', '0', '1.2.3MB', ''])
def test_parse_size_rejects(text):
  with pytest.raises(ValueError, match='512MB'):
    planner.ParseSize(text)


# --- Applying a plan to an experiment (TF, no subprocess) ---------------------


def _BuildTask(cfg, devices, split, train=False):
  """The experiment's task on a worker of `devices` CPUs split by `split`;
  with `train`, its training step built too (task.train_op)."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  task_p = cfg.task.Copy()
  task_p.input = cfg.input.Copy()
  with tf.Graph().as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=devices, split_size=split):
    py_utils.GetOrCreateGlobalStepVar()
    task = task_p.Instantiate()
    if train:
      task.FPropDefaultTheta()
      task.BProp()
    return task


@pytest.mark.parametrize('index', [0, 1])
def test_override_string_builds_the_plan(index):
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams(TINY)
  profile = planner.ProfileExperiment(cfg, TINY)
  plans = [p for p in planner.Enumerate(profile, 2)
           if (p.num_cells, p.num_micro_batches) in ((2, 4), (1, 2))]
  plan = [p for p in plans if p.num_cells == 2 and p.schedule == '1f1b'][0]
  if index:
    plan = [p for p in plans if p.replicas == 2][0]
  cfg = experiment_params.ApplyOverrides(planner.ExperimentParams(TINY),
                                         planner.OverrideString(plan))
  assert cfg.task.num_partitions == plan.num_cells
  assert cfg.task.num_micro_batches == plan.num_micro_batches
  assert cfg.task.schedule == plan.schedule
  assert cfg.task.gradient_sync == plan.gradient_sync
  assert cfg.input.batch_size * plan.replicas == profile.batch
  task = _BuildTask(cfg, plan.devices, plan.devices_per_replica)
  cells = task.pipeline._cells  # pylint: disable=protected-access
  assert len(cells) == plan.num_cells
  assert [len(c.params.sub) for _, c in cells] == list(plan.sizes)
  assert task.pipeline.params.num_micro_batches == plan.num_micro_batches
  assert task.pipeline.params.schedule == plan.schedule
  # ApplyPlan sets the same params.
  applied = planner.ApplyPlan(planner.ExperimentParams(TINY), plan)
  assert applied.ToText() == cfg.ToText()


def test_choose_and_apply():
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams(TINY)
  machine = planner.Machine(flops_per_s=1e10, s_per_op=1e-5, cores=2)
  plan, flags = auto.ChooseAndApply(cfg, TINY, 2, machine=machine)
  assert cfg.task.num_partitions == plan.num_cells
  assert cfg.task.num_micro_batches == plan.num_micro_batches
  assert flags == dict(num_cpu_devices=plan.devices,
                       worker_split_size=plan.devices_per_replica)
  with pytest.raises(planner.PlanError, match='smallest that fits'):
    auto.ChooseAndApply(planner.ExperimentParams(TINY), TINY, 2,
                        memory_per_device=1024, machine=machine)


def _BuiltOps(model, plan, overrides=''):
  """Ops of the plan's training graph: counted ops of the graph (as GraphOps
  counts them) and the nodes of its functions' bodies that compute."""
  cfg = planner.ApplyPlan(planner.ExperimentParams(model, overrides=overrides),
                          plan)
  g = _BuildTask(cfg, plan.devices, plan.devices_per_replica,
                 train=True).train_op.graph
  bodies = sum(n.op not in planner.tf_profiling._FREE_OPS  # pylint: disable=protected-access
               for f in g.as_graph_def().library.function for n in f.node_def)
  return sum(map(planner.tf_profiling._IsCounted, g.get_operations())) + bodies  # pylint: disable=protected-access


@pytest.mark.slow
@pytest.mark.parametrize('schedule,cell_functions', [
    ('unrolled', True), ('zero_bubble', True), ('recurrent', True),
    ('unrolled', False)])
def test_graph_ops_grow_with_micro_batches_as_built(schedule, cell_functions):
  # What the graph gains from M = 1 to M = 8 (2 cells): a call per (cell,
  # micro-batch) where cells are built once, nothing in Lingvo's loop, a
  # copy of every cell per micro-batch inline.
  overrides = '' if cell_functions else 'task.cell_functions:False'
  cfg = planner.ExperimentParams(TINY, overrides=overrides)
  profile = planner.ProfileExperiment(cfg, TINY)
  assert profile.cell_functions == cell_functions
  plans = {p.num_micro_batches: p for p in planner.Enumerate(profile, 2)
           if p.num_cells == 2 and p.replicas == 1 and p.schedule == schedule
           and not (p.recompute and schedule != 'recurrent')}
  built = [_BuiltOps(TINY, plans[m], overrides) for m in (1, 8)]
  predicted = [planner.GraphOps(profile, plans[m]) for m in (1, 8)]
  grown, predicted_growth = built[1] - built[0], predicted[1] - predicted[0]
  if schedule == 'recurrent':
    assert predicted_growth == 0
    assert abs(grown) < 0.02 * built[0], built
  else:
    assert 0.5 < predicted_growth / grown < 2., (built, predicted)


# --- The command line ---------------------------------------------------------


@pytest.mark.parametrize('flags,names', [
    (['--model=lm.NoSuchModel', '--devices=2'], '--model'),
    (['--model=%s' % TINY, '--devices=0'], '--devices'),
    (['--model=%s' % TINY, '--devices=2', '--memory_per_device=2XB'],
     '--memory_per_device'),
    (['--model=%s' % TINY, '--devices=2', '--global_batch=0'],
     '--global_batch'),
    (['--model=%s' % TINY, '--devices=2', '--measure_within=-0.1'],
     '--measure_within'),
    (['--model=%s' % TINY, '--devices=2', '--measure', '--measure_steps=5'],
     '--measure_steps'),
])
def test_bad_flags_exit_2_with_one_line(flags, names, capsys):
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  assert plan_tool.main(flags) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert err.startswith('error: ' + names), err


def test_budget_too_small_exits_2_naming_the_least(capsys):
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  assert plan_tool.main(['--model=%s' % TINY, '--devices=2',
                         '--memory_per_device=1KB', '--no-calibrate']) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert 'the smallest that fits one is' in err
  assert '--memory_per_device=' in err


@pytest.mark.e2e
def test_cli_json_parses_and_runs_the_best():
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.tools.plan', '--model=%s' % TINY,
       '--devices=2', '--memory_per_device=64MB', '--json',
       '--no-calibrate'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout)
  assert out['plans'] and out['best'] == out['plans'][0]
  for p in out['plans']:
    assert p['devices'] <= 2
    assert p['peak_bytes'] <= 64 * 2**20
  assert out['model_params_override'] == planner.OverrideString(
      planner.PlanFromDict(out['best']))
  assert '--num_cpu_devices=%d' % out['best']['devices'] in out['command']
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.tools.plan', '--model=%s' % TINY,
       '--devices=-1'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 2
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize('devices,memory,flag', [
    (0, None, '--devices'), (2, '2XB', '--memory_per_device')])
def test_trainer_auto_plan_bad_flags(devices, memory, flag):
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError) as e:
    auto.TrainerAutoPlan(TINY, devices, memory)
  assert str(e.value).startswith(flag) and '\n' not in str(e.value)


@pytest.mark.e2e
def test_trainer_plan_auto_bad_budget_exits_2(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', '--model=%s' % TINY,
       '--plan=auto', '--devices=2', '--memory_per_device=2XB',
       '--logdir=%s' % tmp_path], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=300, check=False)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith('error: --memory_per_device=2XB'), lines


# --- Engine overheads: hand-offs, gates, gradient sums, Lingvo's loop --------


def _Machine(**kwargs):
  fields = dict(flops_per_s=1e9, s_per_op=0., step_s=0., bytes_per_s=1e30,
                update_ops_per_var=0, add_bytes_per_s=1e30)
  fields.update(kwargs)
  return planner.Machine(**fields)


def test_handoff_bytes_only_across_devices():
  profile = _Profile(out=100.)
  stages = planner.Stages(profile, (2, 2, 2, 2))
  folded = actions.StageSpec(4, 2, 4)  # Stage s on device s % 2.
  one = actions.StageSpec(4, 1, 4)
  a = actions.Action
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
  profile = _Profile(out=100.)
  machine = _Machine(s_per_handoff=1e-3, bytes_per_s=3.2e6)
  plan = lambda k: _Plan(k, 1, 'unrolled', True, profile=profile)
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
    ('zero_bubble', False, actions.KINDS),
    ('interleaved_1f1b', False, actions.KINDS)])
def test_gated_kinds(schedule, recompute, kinds):
  k = 4 if schedule == 'interleaved_1f1b' else 2
  plan = _Plan(k, 4, schedule, recompute, devices=2)
  assert planner.GatedKinds(plan) == kinds
  # A gate costs only where the engine gates: on one core (the step is all
  # the work) each gated action adds one gate.
  one_core = dict(cores=1)
  base = planner.Predict(_Profile(), plan, _Machine(**one_core)).step_s
  gated = planner.Predict(_Profile(), dataclasses.replace(plan),
                          _Machine(s_per_gate=1e-3, **one_core)).step_s
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
  plan = _Plan(k, m, schedule, recompute,
               devices=2 if schedule == 'zero_bubble' and k == 4 else None)
  assert planner.Accumulations(plan) == sums
  # Priced: each sum reads two and writes one of the stage's weight bytes
  # (on one core the step is all the work). 'recurrent' sums each loop
  # step's gradients after the first.
  profile = _Profile(param_bytes=1000)
  one_core = dict(cores=1)
  base = planner.Predict(profile, plan, _Machine(**one_core)).step_s
  priced = planner.Predict(profile, dataclasses.replace(plan), _Machine(
      add_bytes_per_s=1e6, s_per_op=0., **one_core)).step_s
  # 8 layers of 1000 B over the K cells, summed `sums` times each.
  assert priced - base == pytest.approx(sums * 3 * 8000 / 1e6)


# 'unrolled' with recompute runs the engine's r (1 + weights // operands per
# micro-batch, at most M: schedules._Engine._WeightGradientRun); '1f1b'
# without, r where it is longer than K. 8 layers, batch 32, K = 2, M = 8:
# kept activations (the operands' stand-in) 8 x 512 B x 4 examples = 16384 B.
@pytest.mark.parametrize('schedule,param_bytes,run,group', [
    ('unrolled', 1000, 1, 1), ('unrolled', 4096, 3, 3),
    ('unrolled', 100000, 8, 8), ('1f1b', 1000, 1, 2), ('1f1b', 4096, 3, 3),
    ('1f1b', 100000, 8, 8)])
def test_weight_gradient_runs_and_their_sums(schedule, param_bytes, run,
                                             group):
  profile = _Profile(param_bytes=param_bytes)
  plan = _Plan(2, 8, schedule, schedule == 'unrolled', profile=profile)
  assert planner.WeightGradientRun(
      plan, planner.Stages(profile, plan.sizes)) == run
  sums = -(-8 // group) - 1
  assert planner.Accumulations(plan, run) == sums
  one_core = dict(cores=1)
  base = planner.Predict(profile, plan, _Machine(**one_core))
  priced = planner.Predict(profile, dataclasses.replace(plan), _Machine(
      add_bytes_per_s=1e6, s_per_op=0., **one_core))
  assert priced.step_s - base.step_s == pytest.approx(
      sums * 3 * 8 * param_bytes / 1e6)
  # A run's micro-batches are alive together until it, as memory counts
  # them (PeakInFlight): r recomputed micro-batches per device for
  # 'unrolled'; 1F1B's K - d in flight and a run's group - 1 before it.
  spec, lists = planner.ActionSchedule(plan, True, run)
  assert spec.weight_gradient_run == run
  timeline = actions.Simulate(spec, lists)
  want = ([run, run] if schedule == 'unrolled' else
          [min(8, 2 - d + group - 1) for d in range(2)])
  assert [timeline.PeakInFlight(d) for d in range(2)] == want


def test_recurrent_runs_every_cell_at_every_loop_step():
  """Lingvo's StackedRecurrent: M + K - 1 steps, each runs all cells (the
  bubble's on padding) and each backward step recomputes: K = 2, M = 4 is 5
  steps of one cell's F + R + B, and 5 x 2 cells' work on one core."""
  profile = _Profile()
  plan = planner.Predict(profile, _Plan(2, 4, 'recurrent', True),
                         _Machine())
  cell = 4 * 1e6 * 8 / 1e9  # 4 layers of 1e6 FLOPs, 8 examples.
  assert plan.step_s == pytest.approx(5 * cell * (1 + 1 + 2))
  assert plan.bubble == pytest.approx(1 / 5.)
  one_core = planner.Predict(profile, _Plan(2, 4, 'recurrent', True),
                             _Machine(cores=1))
  assert one_core.step_s == pytest.approx(2 * 5 * cell * 4)
  # GPipe's order with recompute skips the bubble's work: on one core it is
  # 4 micro-batches' work, not 5.
  unrolled = planner.Predict(profile, _Plan(2, 4, 'unrolled', True),
                             _Machine(cores=1))
  assert unrolled.step_s == pytest.approx(2 * 4 * cell * 4)


def test_zero_bubble_folds_cells_onto_fewer_devices():
  profile = _Profile()
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
  # Simulated on 2 devices as the engine folds it (actions.FoldOntoDevices):
  # less idle than one cell per device at the same M.
  flat = planner.Predict(profile, _Plan(2, 4, 'zero_bubble'), _FLOPS_ONLY)
  four = planner.Predict(profile, plan, _FLOPS_ONLY)
  spec, lists = planner.ActionSchedule(plan)
  assert spec.num_devices == 2 and len(lists) == 2
  assert four.bubble < flat.bubble


# --- The --measure choice -----------------------------------------------------


def _Predicted(plan, step_s=0.):
  return planner.Candidate(plan, planner.Prediction(
      step_s=step_s, bubble=0., peak_bytes=0., process_bytes=0.,
      comm_bytes=0.))


def _Measured(plan, times):
  return _Predicted(plan).Measured(times=times, step_s=min(times))


def test_measured_noise_is_the_median_spread():
  a = _Measured(_Plan(1, 1), [1.0, 1.1, 1.2])   # Median 10% over the least.
  b = _Measured(_Plan(2, 1), [2.0, 2.6, 2.4])   # 20%.
  c = _Measured(_Plan(2, 4), [1.0, 1.3, 1.01])  # 1%.
  assert planner.MeasuredNoise([a, b, c]) == pytest.approx(0.1)
  assert planner.MeasuredNoise([c]) == pytest.approx(0.01)
  assert planner.MeasuredNoise([_Plan(1, 1)]) == 0.


def test_measured_choice_takes_a_plan_that_wins_round_after_round():
  rounds = [1.00, 1.05, 1.04, 1.20, 1.02, 1.10, 1.01, 1.30, 1.03, 1.06]
  predicted = _Measured(_Plan(1, 1), rounds)  # Spread 4-30%.
  # 2% faster in every round, under the rounds' spread: a real gain.
  steady = _Measured(_Plan(2, 1), [0.98 * t for t in rounds])
  chosen, noise = planner.MeasuredChoice([predicted, steady])
  assert chosen is steady
  assert noise == pytest.approx(0.04)
  # One lucky round, slower in the rest: its fastest round is no reason.
  lucky = _Measured(_Plan(2, 4), [0.5] + [1.4] * 9)
  assert planner.MeasuredChoice([predicted, lucky])[0] is predicted
  # Of two that win every round, the one with the faster rounds.
  fast = _Measured(_Plan(2, 4), [0.8 * t for t in rounds])
  assert planner.MeasuredChoice([predicted, steady, fast])[0] is fast
  # Candidates measured nowhere, or in different rounds: plain errors.
  with pytest.raises(ValueError):
    planner.MeasuredChoice([_Plan(1, 1)])
  with pytest.raises(ValueError):
    planner.MeasuredChoice([predicted, _Measured(_Plan(2, 1), [1.0])])


@pytest.mark.parametrize('num_candidates', [2, 3, 8, 16])
def test_measured_choice_needs_more_wins_among_more_candidates(
    num_candidates):
  """A sign test over all candidates: the bound tightens with their number
  (Bonferroni), so that the best of many noisy candidates is not taken for
  a faster one."""
  least = planner.MinRounds(num_candidates)
  for n, wins, chosen in ((least, least, True), (least - 1, least - 1, False),
                          (least + 4, least + 4, True)):
    predicted = _Measured(_Plan(1, 1), [1.0] * n)
    # Faster by half in `wins` rounds, slower in the others.
    other = _Measured(_Plan(2, 1), [0.5] * wins + [1.5] * (n - wins))
    slow = [_Measured(_Plan(2, 4, replicas=1 + i), [2.0] * n)
            for i in range(num_candidates - 2)]
    pick, _ = planner.MeasuredChoice([predicted, other] + slow)
    assert (pick is other) == chosen, (n, wins)
  # One round lost of least + 4: still chosen where the test allows it.
  n = least + 4
  p = planner.SignTestP(n - 1, n)
  other = _Measured(_Plan(2, 1), [0.5] * (n - 1) + [1.5])
  predicted = _Measured(_Plan(1, 1), [1.0] * n)
  slow = [_Measured(_Plan(2, 4, replicas=1 + i), [2.0] * n)
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
  twin = _Measured(_Plan(1, 1), [1.0, 1.3, 1.4, 1.0, 1.1] * 2)
  rc = _Measured(_Plan(1, 1, recompute=True), [0.7, 1.2, 1.4, 0.9, 1.0] * 2)
  other = _Measured(_Plan(2, 4), [1.05, 1.35, 1.45, 1.05, 1.15] * 2)
  assert planner.Twin(rc, [twin, rc, other]) is twin
  assert planner.Twin(twin, [twin, rc, other]) is None
  # The predicted best: rc; as fast as its twin round by round, so its twin.
  assert planner.MeasuredChoice([rc, other, twin])[0] is twin
  # Without the twin measured, rc's rounds stand: they beat other's in every
  # round.
  assert planner.MeasuredChoice([other, rc])[0] is rc


def test_measure_candidates_add_the_twins():
  from lingvo_ext.planner import measuring  # pylint: disable=g-import-not-at-top
  ranked = [_Predicted(p, t) for p, t in zip(
      [_Plan(2, 4, recompute=True), _Plan(1, 1), _Plan(2, 1), _Plan(2, 4)],
      (1.0, 1.1, 1.2, 1.3))]
  out = measuring.MeasureCandidates(ranked, 2, within=1.)
  assert [p.Key() for p in out] == ['K2xR1 M4 unrolled+rc',
                                    'K1xR1 M1 unrolled', 'K2xR1 M4 unrolled']


def test_measure_candidates_are_those_predicted_close_to_the_best():
  """--measure times the plans predicted within --measure_within of the
  best (at most --measure_top): the predictions cannot tell them apart."""
  from lingvo_ext.planner import measuring  # pylint: disable=g-import-not-at-top
  ranked = [_Predicted(p, t) for p, t in zip(
      [_Plan(1, 1), _Plan(2, 1), _Plan(2, 2), _Plan(1, 2), _Plan(1, 4)],
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
  profile = _Profile()
  num_vars = sum(l.num_vars for l in profile.layers)
  machine = _Machine(s_per_op=1e-6)
  reduce = _Plan(1, 1, replicas=2)
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
  profile = _Profile()
  per_byte = dict(recurrent_s_per_byte=1e-6)
  for k, m, paid in ((1, 4, 3 * 8 * 4096), (2, 1, 1 * 4 * 4096),
                     (1, 1, 0)):
    base = planner.Predict(profile, _Plan(k, m, 'recurrent', True),
                           _Machine()).step_s
    more = planner.Predict(profile, _Plan(k, m, 'recurrent', True),
                           _Machine(**per_byte)).step_s
    assert more - base == pytest.approx(paid * 1e-6), (k, m)
  # Not for the other schedules.
  plan = _Plan(2, 4)
  assert planner.Predict(profile, plan, _Machine(**per_byte)).step_s == (
      pytest.approx(planner.Predict(profile, dataclasses.replace(plan),
                                    _Machine()).step_s))


def test_calibrate_falls_back_when_more_steps_run_faster():
  """If 'recurrent' at the larger M runs faster than its one step allows
  (no cost per further step fits), the factor is fitted on the larger M
  alone, as with three references."""
  profile = _Profile(linear_loss=False)
  truth = planner.Machine(flops_per_s=1e9, s_per_op=3e-5, step_s=4e-3,
                          recurrent_op_factor=0.4, cores=2)
  refs = planner.ReferencePlans(profile)
  times = [planner.Predict(profile, p, truth).step_s for p in refs]
  probed = planner.Machine(flops_per_s=1e9, s_per_op=1e-6, cores=2)
  slow_one_step = times[:3] + [times[3] * 1.5]
  fitted = planner.Calibrate(profile, probed, slow_one_step)
  assert fitted.recurrent_s_per_byte == 0.
  assert fitted == planner.Calibrate(profile, probed, times[:3])
  assert fitted.recurrent_op_factor == pytest.approx(0.4)


def test_bench_sweep_takes_every_plan_the_planner_offers():
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  profile = _Profile(num_layers=6, batch=16)
  offered = [p.Key() for p in planner.Enumerate(profile, 2)]
  assert [p.Key() for p in bench_plan.SweepPlans(TINY, profile, 2)] == offered
  # The FC benchmark runs one replica; --micro_batches narrows the sweep.
  fc = bench_plan.SweepPlans(bench_plan.FC, profile, 2)
  assert [p.Key() for p in fc] == [
      p.Key() for p in planner.Enumerate(profile, 2) if p.replicas == 1]
  some = bench_plan.SweepPlans(TINY, profile, 2, micro_batches=[1, 4])
  assert {p.num_micro_batches for p in some} == {1, 4}
  assert len(some) < len(offered)


def test_bench_repredict_gives_a_saved_run_the_same_predictions():
  # bench/plan.py --from_jsonl F --repredict: a run's own probe and reference
  # measurements, calibrated and predicted again, give back the run's
  # predictions when the planner is the same.
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  profile = bench_plan.Profile(bench_plan.FC)
  probe = planner.Machine(flops_per_s=1e10, s_per_op=2e-5, cores=2)
  truth = dataclasses.replace(probe, step_s=3e-3, overhead_bytes=7e8)
  refs = planner.ReferencePlans(profile)
  ref_s = [planner.Predict(profile, p, truth).step_s for p in refs]
  ref_rss = [planner.Predict(profile, p, truth).process_bytes
             for p in refs[:2]]
  machine = planner.Calibrate(profile, probe, ref_s, ref_rss)
  plans = planner.PredictAll(
      profile, bench_plan.SweepPlans(bench_plan.FC, profile, 2), machine)
  plans = [p.Measured(step_s=p.step_s * (1. + 0.1 * (i % 3)),
                      rss_bytes=p.process_bytes * (1. + 0.01 * (i % 2)))
           for i, p in enumerate(plans)]
  record = json.loads(json.dumps(bench_plan.Summary(
      bench_plan.FC, 2, plans, machine, {}, probe=dataclasses.asdict(probe),
      reference_keys=[p.Key() for p in refs],
      reference_ms=[1e3 * t for t in ref_s],
      reference_rss_mb=[r / 2**20 for r in ref_rss])))
  again = bench_plan.Repredict(record)
  for key in ('spearman', 'chosen_key', 'best_key', 'rows'):
    assert again[key] == record[key], key
  for key in ('mem_err_mean', 'mem_err_max'):  # Rows keep 0.1 MB.
    assert again[key] == pytest.approx(record[key], abs=1e-3), key
  assert 0 < record['mem_err_max'] <= 0.0101


def test_bench_repredict_reads_runs_before_the_reference_keys():
  # Runs without reference_keys timed 'unrolled' at the 'recurrent'
  # reference's M (4), not at 8: calibrated on those plans, not today's.
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  profile = bench_plan.Profile(bench_plan.FC)
  probe = planner.Machine(flops_per_s=1e10, s_per_op=2e-5, cores=2)
  truth = dataclasses.replace(probe, s_per_op=5e-5, step_s=3e-3)
  refs = planner.ReferencePlans(profile)
  assert [p.num_micro_batches for p in refs] == [1, 8, 4, 1]
  old = [refs[0], dataclasses.replace(refs[1], num_micro_batches=4)] + refs[2:]
  ref_s = [planner.Predict(profile, p, truth).step_s for p in old]
  plans = planner.PredictAll(
      profile, bench_plan.SweepPlans(bench_plan.FC, profile, 2),
      planner.Calibrate(profile, probe, ref_s, refs=old))
  plans = [p.Measured(step_s=p.step_s, rss_bytes=p.process_bytes)
           for p in plans]
  record = json.loads(json.dumps(bench_plan.Summary(
      bench_plan.FC, 2, plans, truth, {}, probe=dataclasses.asdict(probe),
      reference_ms=[1e3 * t for t in ref_s], reference_rss_mb=[])))
  again = bench_plan.Repredict(record)
  assert again['rows'] == record['rows']
  with pytest.raises(ValueError, match='references'):
    bench_plan.Repredict(dict(record, reference_keys=[p.Key() for p in old]))


# --- Pipelines that come cut (planner/tree.py) --------------------------------


def test_tree_plans_keep_the_cells_and_share_the_devices():
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  lm = tree.TreePipeline(path='task.lm.stack', cls_name='Stack',
                         profile=_Profile(num_layers=2, batch=8,
                                          linear_loss=False))
  other = tree.TreePipeline(path='task.enc.stack', cls_name='PipeliningLayer',
                            profile=_Profile(num_layers=4, batch=8,
                                             linear_loss=False),
                            micro_batch_size=2)
  ranked = tree.ChooseTree([lm, other], devices=4)
  assert [pipe.path for pipe, _ in ranked] == ['task.lm.stack',
                                               'task.enc.stack']
  for pipe, plans in ranked:
    k = len(pipe.profile.layers)
    assert plans and all(p.num_cells == k and p.replicas == 1 for p in plans)
    assert all(8 % p.num_micro_batches == 0 for p in plans)
  # The second pipeline runs on the first one's devices.
  assert (ranked[1][1][0].devices_per_replica ==
          ranked[0][1][0].devices_per_replica)
  chosen = [(pipe, plans[0]) for pipe, plans in ranked]
  overrides = tree.TreeOverrides(*chosen[1])
  best = chosen[1][1]
  assert overrides['task.enc.stack.num_micro_batches'] == (
      best.num_micro_batches)
  assert overrides['task.enc.stack.schedule'] == best.schedule
  # A micro_batch_size the new count would contradict is reset.
  assert overrides['task.enc.stack.micro_batch_size'] is None
  assert 'task.lm.stack.micro_batch_size' not in tree.TreeOverrides(
      *chosen[0])
  text = tree.TreeOverrideString(chosen)
  assert text.count(';') == 6 and 'task.enc.stack.micro_batch_size:None' in text
  assert 'task.lm.stack.schedule:"%s"' % chosen[0][1].schedule in text
  # Within a budget too small for any plan: the least that would fit.
  with pytest.raises(planner.PlanError) as e:
    tree.ChooseTree([lm], devices=2, memory_per_device=1)
  assert '--memory_per_device' in str(e.value)
