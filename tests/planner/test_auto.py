"""--plan=auto (auto.py): the plan chosen, set on the trainer's params."""

import os
import sys

import pytest

from lingvo_ext import planner
from tests.support import ROOT
from tests.support import planner_testlib as lib
from tests.support import zygote


def test_plan_params_sets_the_plan_its_override_rebuilds():
  """--plan=auto on params built once: the plan set typed on a copy; the
  printed override, parsed from the experiment, builds the same params."""
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  user = 'task.train.learning_rate:0.002'
  built = experiment_params.GetParams(lib.TINY, 'Train', user)
  before = built.ToText()
  machine = planner.Machine(flops_per_s=1e10, s_per_op=1e-5, cores=2)
  chosen = auto.PlanParams(built, lib.TINY, 2, overrides=user, machine=machine)
  assert built.ToText() == before  # The trainer's params stay as built.
  assert chosen.override.startswith(user + '; ')
  rebuilt = experiment_params.GetParams(lib.TINY, 'Train', chosen.override)
  assert chosen.params.ToText() == rebuilt.ToText()
  assert chosen.params.task.num_partitions == chosen.plan.num_cells
  assert chosen.params.task.train.learning_rate == 0.002
  assert chosen.flags == dict(num_cpu_devices=chosen.plan.devices,
                              worker_split_size=chosen.plan.devices_per_replica)
  assert f"--model_params_override='{chosen.override}'" in chosen.line


def test_choose_and_apply():
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams(lib.TINY)
  machine = planner.Machine(flops_per_s=1e10, s_per_op=1e-5, cores=2)
  plan, flags = auto.ChooseAndApply(cfg, lib.TINY, 2, machine=machine)
  assert cfg.task.num_partitions == plan.num_cells
  assert cfg.task.num_micro_batches == plan.num_micro_batches
  assert flags == dict(num_cpu_devices=plan.devices,
                       worker_split_size=plan.devices_per_replica)
  with pytest.raises(planner.PlanError, match='smallest that fits'):
    auto.ChooseAndApply(planner.ExperimentParams(lib.TINY), lib.TINY, 2,
                        memory_per_device=1024, machine=machine)


def _TinyRanked():
  """Memory constants without a graph term, a machine, the tiny experiment's
  params and profile, and --plan=auto's ranking of its plans."""
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  c = memory_model.Constants(runtime_bytes=100 * 2**20, activation_factor=1.,
                             bytes_per_op=0.)
  machine = planner.Machine(flops_per_s=1e10, s_per_op=1e-5, cores=2)
  cfg = planner.ExperimentParams(lib.TINY)
  profile = planner.ProfileExperiment(cfg, lib.TINY)
  return c, machine, cfg, profile, auto.ChooseForExperiment(
      cfg, lib.TINY, 2, machine=machine)


def test_plan_params_never_picks_a_plan_the_memory_does_not_hold():
  """--plan=auto takes the process's memory (the cgroup's limit, else the
  machine's) as a constraint on the plans' predicted peak RSS."""
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  c, machine, cfg, profile, ranked = _TinyRanked()
  needs = sorted({memory_model.Predict(profile, r.plan, c).rss_bytes
                  for r in ranked})
  assert len(needs) > 1
  # Between the least and the most: the fastest plan that fits is chosen.
  limit = (needs[0] + needs[-1]) / 2
  chosen = auto.PlanParams(cfg, lib.TINY, 2, machine=machine,
                           available=limit, constants=c)
  fitting = [r for r in ranked
             if memory_model.Predict(profile, r.plan, c).rss_bytes <= limit]
  assert chosen.plan.plan == fitting[0].plan
  assert memory_model.Predict(profile, chosen.plan.plan,
                              c).rss_bytes <= limit
  with pytest.raises(ValueError) as e:
    auto.PlanParams(cfg, lib.TINY, 2, machine=machine,
                    available=needs[0] - 1, constants=c)
  assert str(e.value).startswith('--plan=auto: no plan fits in the memory (')
  assert '\n' not in str(e.value)


def test_plan_params_counts_the_input_buffer_in_the_memory(monkeypatch):
  """The input's record buffer (input_memory, the same for every plan) is
  in the need --plan=auto compares with the memory, as in the start
  check's."""
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import input_memory  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  c, machine, cfg, profile, ranked = _TinyRanked()
  needs = [memory_model.Predict(profile, r.plan, c).rss_bytes for r in ranked]
  buffered = 300 * 2**20
  monkeypatch.setattr(input_memory, 'RunBufferBytes', lambda p: buffered)
  # Enough for every plan's model terms, not with the buffer beside the
  # least of them: refused, the need named with the buffer in it.
  with pytest.raises(ValueError) as e:
    auto.PlanParams(cfg, lib.TINY, 2, machine=machine,
                    available=max(needs) + 1, constants=c)
  least = planner.FormatSize(min(needs) + buffered)
  assert f'the least needs about {least} of peak RSS' in str(e.value)
  # With room for the buffer and half of the plans: the fastest of those.
  limit = (min(needs) + max(needs)) / 2
  chosen = auto.PlanParams(cfg, lib.TINY, 2, machine=machine,
                           available=limit + buffered, constants=c)
  fitting = [r for r, need in zip(ranked, needs) if need <= limit]
  assert chosen.plan.plan == fitting[0].plan
  assert len(fitting) < len(ranked)


@pytest.mark.parametrize('devices,memory,flag', [
    (0, None, '--devices'), (2, '2XB', '--memory_per_device')])
def test_trainer_auto_plan_bad_flags(devices, memory, flag):
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError) as e:
    auto.TrainerAutoPlan(lib.TINY, devices, memory)
  assert str(e.value).startswith(flag) and '\n' not in str(e.value)


@pytest.mark.e2e
def test_trainer_plan_auto_bad_budget_exits_2(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', '--model=%s' % lib.TINY,
       '--plan=auto', '--devices=2', '--memory_per_device=2XB',
       '--logdir=%s' % tmp_path], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=300, check=False)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith('error: --memory_per_device=2XB'), lines
