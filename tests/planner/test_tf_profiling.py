"""The planner's TensorFlow half (tf_profiling.py): graph ops as built."""

import pytest

from lingvo_ext import planner
from tests.support import planner_testlib as lib


def _BuiltOps(model, plan, overrides=''):
  """Ops of the plan's training graph: counted ops of the graph (as GraphOps
  counts them) and the nodes of its functions' bodies that compute."""
  cfg = planner.ApplyPlan(planner.ExperimentParams(model, overrides=overrides),
                          plan)
  g = lib.BuildTask(cfg, plan.devices, plan.devices_per_replica,
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
  cfg = planner.ExperimentParams(lib.TINY, overrides=overrides)
  profile = planner.ProfileExperiment(cfg, lib.TINY)
  assert profile.cell_functions == cell_functions
  plans = {p.num_micro_batches: p for p in planner.Enumerate(profile, 2)
           if p.num_cells == 2 and p.replicas == 1 and p.schedule == schedule
           and not (p.recompute and schedule != 'recurrent')}
  built = [_BuiltOps(lib.TINY, plans[m], overrides) for m in (1, 8)]
  predicted = [planner.GraphOps(profile, plans[m]) for m in (1, 8)]
  grown, predicted_growth = built[1] - built[0], predicted[1] - predicted[0]
  if schedule == 'recurrent':
    assert predicted_growth == 0
    assert abs(grown) < 0.02 * built[0], built
  else:
    assert 0.5 < predicted_growth / grown < 2., (built, predicted)
