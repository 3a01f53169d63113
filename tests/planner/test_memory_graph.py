"""The memory model's graph term: the training graph's nodes it counts
(memory_model.GraphNodes, tree_memory.TrainingGraphNodes) against the
graphs the trainer's task builds."""

import pytest

from lingvo_ext import planner
from lingvo_ext.planner import memory_model
from lingvo_ext.planner import tree_memory
from tests.support import planner_testlib as lib


def testTheGraphTermIsTheNodesTimesTheProbesBytesPerNode():
  layers = tuple(planner.LayerProfile(
      name=f'l{i}', flops=1e6, fwd_ops=10, bwd_ops=20, param_bytes=10,
      num_vars=3, out_bytes=100., kept_bytes=100.) for i in range(2))
  profile = planner.ModelProfile(name='m', layers=layers, batch=16,
                                 in_bytes=8., optimizer_slots=2,
                                 linear_loss=True, cell_functions=False)
  plan = planner.Plan(num_cells=1, sizes=(2,), devices_per_replica=1,
                      num_micro_batches=2, schedule='unrolled',
                      recompute=False, replicas=1, gradient_sync='shared',
                      global_batch=16)
  # Inline cells: a copy per micro-batch of each layer's 10 + 20 ops, the
  # loss's, 12 per variable.
  ops = 2 * 2 * (10 + 20) + profile.loss_ops + 6 * 12
  assert planner.GraphOps(profile, plan) == ops
  nodes = 1.5 * ops + 56 * 6 + 400
  assert memory_model.GraphNodes(profile, plan) == nodes
  c = memory_model.Constants(runtime_bytes=0., activation_factor=1.,
                             bytes_per_op=1000.)
  assert memory_model.Predict(profile, plan, c).Terms()['graph'] == (
      1000. * nodes)


def _Built(cfg, devices=2):
  """The nodes of the experiment's training graph as its task builds it (as
  the tests of the planner build a task: tests/support/planner_testlib)."""
  task = lib.BuildTask(cfg, devices, devices, train=True)
  return tree_memory.BuiltNodes(task.train_op.graph)


@pytest.mark.slow
@pytest.mark.parametrize('overrides,low,high', [
    # Cell functions: the forward body twice (the call's and the gradient's
    # forward function), the backward one once.
    ('', 1.0, 1.1),
    ('task.num_micro_batches:8', 1.0, 1.1),
    # Inline cells, one micro-batch: the formula's worst case among these.
    ('task.cell_functions:False', 1.1, 1.25),
    # The probe's graph of many ops: each cell copied per micro-batch.
    ('task.cell_functions:False; task.num_micro_batches:8; '
     'task.num_layers:4', 0.95, 1.05),
])
def testThePredictedNodesAreTheBuiltTrainingGraphs(overrides, low, high):
  cfg = planner.ExperimentParams(lib.TINY, overrides=overrides)
  profile = planner.ProfileExperiment(cfg, lib.TINY)
  plan = memory_model.PlanOfParams(profile, cfg.task, 2, 2)
  built = _Built(cfg)
  # What the memory probe and the tree path count: the same graph.
  assert tree_memory.TrainingGraphNodes(cfg, 2, 2) == built
  assert low <= memory_model.GraphNodes(profile, plan) / built <= high, built


def test_the_node_count_process_ends_with_the_one_that_started_it(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ('from lingvo_ext.planner import tree_memory\n'
          'tree_memory.CountMain()\n')
  # Pid 1 is not its parent: as if the starting process had died first.
  res = subprocess.run(
      [sys.executable, '-c', code, str(tmp_path / 'absent.pickle'), '1'],
      capture_output=True, text=True, timeout=120, check=False)
  assert res.returncode == 1 and not res.stdout, res.stderr[-2000:]


def test_a_failed_count_is_one_runtime_error_with_its_last_line(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  # A NodeCount whose process fails at once (no params to build).
  count = tree_memory.NodeCount.__new__(tree_memory.NodeCount)
  count._dir = tempfile.TemporaryDirectory(dir=tmp_path)  # pylint: disable=protected-access
  count._err = open(tmp_path / 'err', 'w+b')  # pylint: disable=protected-access,consider-using-with
  count._proc = subprocess.Popen(  # pylint: disable=protected-access,consider-using-with
      [sys.executable, '-c', 'import sys; print("boom", file=sys.stderr); '
       'sys.exit(3)'], stdout=subprocess.PIPE, stderr=count._err)  # pylint: disable=protected-access
  with pytest.raises(RuntimeError, match='build failed: boom$'):
    count.Result()
