"""The automatic plan (issue 24): lingvo_ext/core/planner.py, tools/plan.py."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from lingvo_ext.core import actions
from lingvo_ext.core import partitioning
from lingvo_ext.core import planner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    if p.schedule != 'interleaved_1f1b':
      assert p.num_cells * p.replicas <= devices
    else:
      assert p.num_cells % p.devices_per_replica == 0
      assert p.num_cells > p.devices_per_replica
    assert sum(p.sizes) == 8 and len(p.sizes) == p.num_cells
    assert (p.global_batch // p.replicas) % p.num_micro_batches == 0
  # Every K * R <= N is offered (K = D), and nothing more.
  kr = {(p.num_cells, p.replicas) for p in plans
        if p.schedule != 'interleaved_1f1b'}
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
def test_gpipe_bubble_is_k_minus_1_over_m_plus_k_minus_1(k, m):
  spec = actions.StageSpec(k, k, m)
  tl = actions.Simulate(spec, actions.Build('unrolled', spec),
                        actions.UnitCost)
  assert tl.IdleFraction() == pytest.approx((k - 1) / (m + k - 1))
  # The planner's own simulation (equal stages, compute only) agrees.
  profile = _Profile(num_layers=k * 2, batch=16 * 3)
  plan = planner.Predict(profile, _Plan(k, m, profile=profile), _FLOPS_ONLY)
  assert plan.bubble == pytest.approx((k - 1) / (m + k - 1))


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
  # Step = (M + K - 1) (F + B) of one micro-batch stage: 3 * 2e6 FLOPs per
  # example per stage.
  mb = 32 // 8
  assert times[-1] == pytest.approx((8 + 3) * 3 * 2e6 * mb / 1e9)


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


def test_calibrate_recovers_the_constants():
  profile = _Profile(linear_loss=False)
  truth = planner.Machine(flops_per_s=1e9, s_per_op=3e-5, step_s=4e-3,
                          recurrent_op_factor=0.4, bytes_per_op=2048.,
                          overhead_bytes=5e8, cores=2)
  refs = planner.ReferencePlans(profile)
  times = [planner.Predict(profile, p, truth).step_s for p in refs]
  rss = [planner.Predict(profile, p, truth).process_bytes for p in refs]
  probed = planner.Machine(flops_per_s=1e9, s_per_op=1e-6, cores=2)
  fitted = planner.Calibrate(profile, probed, times, rss)
  for field in ('s_per_op', 'step_s', 'recurrent_op_factor', 'bytes_per_op',
                'overhead_bytes'):
    assert getattr(fitted, field) == pytest.approx(getattr(truth, field)), (
        field)


def test_spearman():
  assert planner.Spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
  assert planner.Spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
  assert planner.Spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


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


def _BuildTask(cfg, devices, split):
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  task_p = cfg.task.Copy()
  task_p.input = cfg.input.Copy()
  with tf.Graph().as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=devices, split_size=split):
    py_utils.GetOrCreateGlobalStepVar()
    return task_p.Instantiate()


@pytest.mark.parametrize('index', [0, 1])
def test_override_string_builds_the_plan(index):
  from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams(TINY)
  profile = planner.ProfileExperiment(cfg, TINY)
  plans = [p for p in planner.Enumerate(profile, 2)
           if (p.num_cells, p.num_micro_batches) in ((2, 4), (1, 2))]
  plan = [p for p in plans if p.num_cells == 2 and p.schedule == '1f1b'][0]
  if index:
    plan = [p for p in plans if p.replicas == 2][0]
  cfg = registry.ApplyOverrides(planner.ExperimentParams(TINY),
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
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams(TINY)
  machine = planner.Machine(flops_per_s=1e10, s_per_op=1e-5, cores=2)
  plan, flags = plan_tool.ChooseAndApply(cfg, TINY, 2, machine=machine)
  assert cfg.task.num_partitions == plan.num_cells
  assert cfg.task.num_micro_batches == plan.num_micro_batches
  assert flags == dict(num_cpu_devices=plan.devices,
                       worker_split_size=plan.devices_per_replica)
  with pytest.raises(planner.PlanError, match='smallest that fits'):
    plan_tool.ChooseAndApply(planner.ExperimentParams(TINY), TINY, 2,
                             memory_per_device=1024, machine=machine)


# --- The command line ---------------------------------------------------------


@pytest.mark.parametrize('flags,names', [
    (['--model=lm.NoSuchModel', '--devices=2'], '--model'),
    (['--model=%s' % TINY, '--devices=0'], '--devices'),
    (['--model=%s' % TINY, '--devices=2', '--memory_per_device=2XB'],
     '--memory_per_device'),
    (['--model=%s' % TINY, '--devices=2', '--global_batch=0'],
     '--global_batch'),
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
  proc = subprocess.run(
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
  proc = subprocess.run(
      [sys.executable, '-m', 'lingvo_ext.tools.plan', '--model=%s' % TINY,
       '--devices=-1'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 2
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize('devices,memory,flag', [
    (0, None, '--devices'), (2, '2XB', '--memory_per_device')])
def test_trainer_auto_plan_bad_flags(devices, memory, flag):
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError) as e:
    plan_tool.TrainerAutoPlan(TINY, devices, memory)
  assert str(e.value).startswith(flag) and '\n' not in str(e.value)


@pytest.mark.e2e
def test_trainer_plan_auto_bad_budget_exits_2(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', '--model=%s' % TINY,
       '--plan=auto', '--devices=2', '--memory_per_device=2XB',
       '--logdir=%s' % tmp_path], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=300, check=False)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith('error: --memory_per_device=2XB'), lines


def test_schedule_names_match_the_engines():
  # planner keeps the engine's schedule names to stay TF-free; they must
  # not drift apart.
  from lingvo_ext.core import schedules  # pylint: disable=g-import-not-at-top
  assert set(planner.SCHEDULE_NAMES) == set(schedules.SCHEDULES)
  assert set(planner.LIST_SCHEDULES) == set(schedules.LINEAR_LOSS_ONLY)
  assert set(planner.ALWAYS_RECOMPUTE) == set(schedules.ALWAYS_RECOMPUTE)
