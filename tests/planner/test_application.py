"""A plan applied to an experiment (application.py): params, text, Spearman."""

import sys

import pytest

from lingvo_ext import planner
from tests.support import ROOT
from tests.support import planner_testlib as lib


def test_spearman():
  sys.path.insert(0, ROOT)
  from bench import plan as bench_plan  # pylint: disable=g-import-not-at-top
  assert bench_plan.Spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
  assert bench_plan.Spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
  assert bench_plan.Spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


@pytest.mark.parametrize('index', [0, 1])
def test_override_string_builds_the_plan(index):
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams(lib.TINY)
  profile = planner.ProfileExperiment(cfg, lib.TINY)
  plans = [p for p in planner.Enumerate(profile, 2)
           if (p.num_cells, p.num_micro_batches) in ((2, 4), (1, 2))]
  plan = [p for p in plans if p.num_cells == 2 and p.schedule == '1f1b'][0]
  if index:
    plan = [p for p in plans if p.replicas == 2][0]
  cfg = experiment_params.ApplyOverrides(planner.ExperimentParams(lib.TINY),
                                         planner.OverrideString(plan))
  assert cfg.task.num_partitions == plan.num_cells
  assert cfg.task.num_micro_batches == plan.num_micro_batches
  assert cfg.task.schedule == plan.schedule
  assert cfg.task.gradient_sync == plan.gradient_sync
  assert cfg.input.batch_size * plan.replicas == profile.batch
  task = lib.BuildTask(cfg, plan.devices, plan.devices_per_replica)
  cells = task.pipeline._cells  # pylint: disable=protected-access
  assert len(cells) == plan.num_cells
  assert [len(c.params.sub) for _, c in cells] == list(plan.sizes)
  assert task.pipeline.params.num_micro_batches == plan.num_micro_batches
  assert task.pipeline.params.schedule == plan.schedule
  # ApplyPlan sets the same params.
  applied = planner.ApplyPlan(planner.ExperimentParams(lib.TINY), plan)
  assert applied.ToText() == cfg.ToText()
