"""The memory estimate at start, before the model is built
(preflight/start_memory.py, planner/tree_memory.py)."""

import collections
import dataclasses
import re

import lingvo.compat as tf
import pytest

from lingvo_ext.planner import memory_model
from lingvo_ext.planner import tree_memory
from lingvo_ext.preflight import memory_check
from lingvo_ext.preflight import start_memory
from lingvo_ext.tasks import experiment_params
from tests.support import flagship_testlib
from tests.support import lingvo_lm_testlib

# Known constants: the tests hold the model's formula, not this machine's.
_CONSTANTS = memory_model.Constants(runtime_bytes=700 * 2**20,
                                    activation_factor=1.5,
                                    bytes_per_op=10 * 1024.)


def _Profile(kept, linear_loss=True):
  """A planner ModelProfile of 4 layers, `kept` activation bytes each.

  The weights are small beside the activations, so that the engine takes
  each micro-batch's weight gradients alone (a run of 1, runs.py).
  """
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  layers = tuple(planner.LayerProfile(
      name=f'l{i}', flops=1e6, fwd_ops=0, bwd_ops=0, param_bytes=10,
      num_vars=1, out_bytes=kept, kept_bytes=kept) for i in range(4))
  return planner.ModelProfile(name='m', layers=layers, batch=16,
                              in_bytes=0., optimizer_slots=2,
                              linear_loss=linear_loss)


def _Plan(schedule, m, recompute=False):
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  return planner.Plan(num_cells=2, sizes=(2, 2), devices_per_replica=2,
                      num_micro_batches=m, schedule=schedule,
                      recompute=recompute, replicas=1,
                      gradient_sync='shared', global_batch=16)


def testStartEstimateKeepsTheActivationsTheScheduleKeeps():
  kept = 100.
  profile = _Profile(kept)
  # Per example: each cell keeps its 2 layers' activations, and cell 1 its
  # input (cell 0's output) too; the last cell's output and its gradient
  # (2 * kept per example) wait for the loss.
  cells = [2 * kept, 2 * kept + kept]
  loss = 2 * kept * 16
  weights = 4 * 10 * (2 + 2)
  for m in (1, 2, 4, 8, 16):
    mb = 16 // m
    # GPipe ('unrolled') keeps every micro-batch's activations on every
    # cell: the whole batch's, whatever M.
    got = start_memory.Estimate(profile, _Plan('unrolled', m))
    assert got.activation_bytes == m * mb * sum(cells) + loss, m
    assert got.process_bytes == got.activation_bytes + weights
    # 1F1B keeps at most K - i + 1 micro-batches' in cell i (its next
    # forward pass starts before the oldest's backward pass ends): fewer
    # bytes with more M.
    got = start_memory.Estimate(profile, _Plan('1f1b', m))
    in_flight = [min(m, 3), min(m, 2)]
    assert got.activation_bytes == sum(
        n * mb * c for n, c in zip(in_flight, cells)) + loss, m
  # Recompute keeps the cells' inputs of every micro-batch and one
  # micro-batch's whole activations per cell.
  got = start_memory.Estimate(profile, _Plan('unrolled', 8, True))
  boundary = kept * 16  # Cell 1's input, every example.
  assert got.activation_bytes == boundary + 2 * 2 * (2 * kept) + loss


def testStartWarningNamesTheNeedTheLimitAndAnOverrideThatFits():
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams('lm.TransformerLmTinyGPipe')
  profile = start_memory.Profile(cfg)
  plan = start_memory.PlanOfParams(profile, cfg.task, 2, 2)
  assert (plan.schedule, plan.num_cells, plan.num_micro_batches,
          plan.devices_per_replica, plan.recompute) == ('unrolled', 2, 2, 2,
                                                        False)
  got = start_memory.Estimate(profile, plan, _CONSTANTS)
  assert got.activation_bytes > 0
  assert got.rss_bytes == sum(got.rss_terms.values())
  assert start_memory.StartWarning(cfg, 2, 2, '', got.rss_bytes, 'x',
                                   _CONSTANTS) is None
  # A tenth of the tensors' bytes less (the graph's nodes, most of this
  # tiny model's bytes, are not what the overrides save).
  model = got.rss_bytes - got.rss_terms['runtime'] - got.rss_terms['graph']
  limit = got.rss_bytes - model * 0.1
  line = start_memory.StartWarning(cfg, 2, 2, 'train.max_steps:5', limit,
                                   "the cgroup's memory limit", _CONSTANTS)
  size = start_memory.task_health.FormatBytes
  head = (f'warning: the run needs about {size(got.rss_bytes)} '
          f'({start_memory.TermsText(got.rss_terms)}; the '
          'activations task.schedule="unrolled" keeps over 2 micro-batch(es) '
          "without recompute), but the cgroup's memory limit is "
          f'{size(limit)}: it may be killed by the OOM killer; an override '
          'that fits (about ')
  assert line.startswith(head), line
  override = re.search(r"--model_params_override='([^']*)'\.$", line)[1]
  assert override.startswith('train.max_steps:5; '), line
  # The override it names is re-estimated by the same model and fits.
  fixed = planner.ExperimentParams('lm.TransformerLmTinyGPipe',
                                   overrides=override)
  # Profiled again under the override (bf16 activations take half).
  after = start_memory.EstimateRun(fixed, 2, 2, _CONSTANTS)
  assert after.rss_bytes <= limit < got.rss_bytes
  assert f'(about {size(after.rss_bytes)})' in line
  assert start_memory.StartWarning(fixed, 2, 2, override, limit, 'x',
                                   _CONSTANTS) is None
  line = start_memory.StartWarning(cfg, 2, 2, '', 1000, 'x', _CONSTANTS)
  assert line.endswith('no override of micro-batches, recompute, schedule or '
                       'bf16 fits; use more memory or more devices.'), line


def testTheTrainersStartWarningBuildsNoModelAndNoLayerGraph(
    monkeypatch, capsys):
  from lingvo_ext.pipeline import cost  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tf_profiling  # pylint: disable=g-import-not-at-top
  from lingvo_ext.preflight import param_checks  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import trainer_flags  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks.lm import model as lm_model  # pylint: disable=g-import-not-at-top
  counts = collections.Counter()

  def Counted(name, fn):
    def Wrapped(*args, **kwargs):
      counts[name] += 1
      return fn(*args, **kwargs)
    return Wrapped

  monkeypatch.setattr(memory_check, 'AvailableBytes',
                      lambda: (64 << 10, "the cgroup's memory limit"))
  monkeypatch.setattr(memory_probe, 'Get', lambda n, force=False: _CONSTANTS)
  monkeypatch.setattr(cost, 'Sandbox', Counted('graphs', cost.Sandbox))
  monkeypatch.setattr(tf_profiling, '_LayerGraphStats',
                      Counted('layer_graphs', tf_profiling._LayerGraphStats))  # pylint: disable=protected-access
  monkeypatch.setattr(lm_model.TransformerLm, '__init__', Counted(
      'models', lm_model.TransformerLm.__init__))
  ops = len(tf.get_default_graph().get_operations())
  o = trainer_flags.Options(model='lm.TransformerLmTinyGPipe',
                            logdir='/nonexistent/x', run_locally='cpu',
                            num_cpu_devices=2, worker_split_size=2)
  error, _ = param_checks.Check(o)
  assert error is None
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if l.startswith('warning: the run')]
  assert len(lines) == 1 and "the cgroup's memory limit is 64 KB" in lines[0]
  # Printed once: on stderr by the check, not through absl as well.
  assert err.count('warning: the run') == 1, err
  # No model built: a throw-away graph per distinct layer (embedding,
  # transformer layer, softmax) for its variables' shapes, and one with its
  # FProp and gradients for the activations its backward pass reads; nothing
  # in the default graph.
  assert counts == {'graphs': 6, 'layer_graphs': 3}, counts
  assert len(tf.get_default_graph().get_operations()) == ops
  # --plan=auto warns with its own estimate; an evaler trains nothing.
  param_checks.Check(dataclasses.replace(o, job='evaler_dev'))
  assert 'warning: the run' not in capsys.readouterr().err


# --- Lingvo's own GPipe LM: its pipeline in its Params tree --------------------


@pytest.fixture
def lingvo_lm(tmp_path, monkeypatch):
  """Lingvo's GPipe LM experiment (tests/support/lingvo_lm_testlib), its
  params on lingvo_ext's engine: time axis 16, batch 8, width 64, vocab 128,
  2 cells over 4 layers, 4 micro-batches."""
  lingvo_lm_testlib.Write(str(tmp_path))
  monkeypatch.syspath_prepend(str(tmp_path))
  return experiment_params.GetParams(lingvo_lm_testlib.MODEL, 'Train')


def testTreeEstimateReadsTheTasksVariablesAndEachCellsOutputs(lingvo_lm):
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  mem = tree_memory.ProfileTaskMemory(lingvo_lm)
  assert [p.path for p in mem.pipes] == ['task.lm.stack']
  profile = mem.pipes[0].profile
  assert (profile.batch, mem.optimizer_slots) == (8, 2)  # Adam: 2 slots.
  # Per example, cell 0 hands on the vectors [T, D] and paddings [T] of the
  # time axis the task trims, sized by the input's longest (16); cell 1
  # gives the logits [T, vocab], float32.
  assert [(l.name, l.out_bytes) for l in profile.layers] == [
      ('cell_0', 16 * (64 + 1) * 4), ('cell_1', 16 * 128 * 4)]
  assert profile.in_bytes == 16 * 4  # The paddings (the ids are int).
  # Its variables are the built task's, all in the pipeline here (the
  # embedding and softmax are cells' layers).
  cluster = cluster_factory.ForTestingWorker(mode='sync', job='trainer_client',
                                             cpus=1, split_size=1)
  with tf.Graph().as_default() as graph, cluster:
    step = py_utils.GetOrCreateGlobalStepVar()
    task_p = lingvo_lm.task.Copy()
    task_p.input = lingvo_lm.input.Copy()
    task = task_p.Instantiate()
    task.FPropDefaultTheta()
    built = memory_check.GraphVariableBytes(graph) - step.dtype.size
  assert mem.param_bytes == built > 0
  assert profile.param_bytes == built and mem.other_param_bytes == 0


def _TreeEstimate(cfg, devices=2, split=2, constants=_CONSTANTS):
  """(the model's estimated bytes, the plan) of the LM's pipeline."""
  mem = tree_memory.ProfileTaskMemory(cfg)
  (pipe,), (p,) = mem.pipes, mem.params
  plan = start_memory.PlanOfPipeline(pipe, p, devices, split)
  got = start_memory.EstimateRun(cfg, devices, split, constants)
  return got, plan


_NO_GRAPH = dataclasses.replace(_CONSTANTS, bytes_per_op=0.)


def testTreeWarningNamesThePipelinesOwnOverrideThatFits(lingvo_lm):
  got, plan = _TreeEstimate(lingvo_lm, constants=_NO_GRAPH)
  assert (plan.num_cells, plan.num_micro_batches,
          plan.devices_per_replica) == (2, 4, 2)
  assert got.rss_bytes == sum(got.rss_terms.values())
  assert start_memory.StartWarning(lingvo_lm, 2, 2, '', got.rss_bytes, 'x',
                                   _NO_GRAPH) is None
  # The logits and their gradient wait for the loss whatever the plan, and
  # recompute keeps every layer's output (memory_model): a fortieth of the
  # activations less fits with recompute over more micro-batches (graph
  # nodes not counted here: each micro-batch more adds some).
  limit = got.rss_bytes - got.rss_terms['activations'] / 40
  line = start_memory.StartWarning(lingvo_lm, 2, 2, 'train.max_steps:5',
                                   limit, "the cgroup's memory limit",
                                   _NO_GRAPH)
  size = start_memory.Size
  rc = 'with' if plan.recompute else 'without'
  head = (f'warning: the run needs about {size(got.rss_bytes)} '
          f'({start_memory.TermsText(got.rss_terms)}; the '
          f'activations task.lm.stack.schedule="{plan.schedule}" keeps over '
          f'4 micro-batch(es) {rc} recompute), but the cgroup\'s memory limit '
          f'is {size(limit)}: it may be killed by the OOM killer; an override '
          'that fits (about ')
  assert line.startswith(head), line
  override = re.search(r"--model_params_override='([^']*)'\.$", line)[1]
  assert override.startswith('train.max_steps:5; task.lm.stack.'), line
  # The override is the experiment's own param path, and it fits by the
  # same model of the params it gives.
  fixed = experiment_params.GetParams(lingvo_lm_testlib.MODEL, 'Train',
                                      override)
  after, _ = _TreeEstimate(fixed, constants=_NO_GRAPH)
  assert after.rss_bytes <= limit < got.rss_bytes
  assert f'(about {size(after.rss_bytes)})' in line
  assert start_memory.StartWarning(fixed, 2, 2, override, limit, 'x',
                                   _NO_GRAPH) is None
  line = start_memory.StartWarning(lingvo_lm, 2, 2, '', 1000, 'x',
                                   _NO_GRAPH)
  assert line.endswith('no override of micro-batches, recompute or schedule '
                       'fits; use more memory or more devices.'), line


def testTheTreePathsGraphTermCountsItsBuiltTrainingGraph(lingvo_lm):
  from tests.support import planner_testlib  # pylint: disable=g-import-not-at-top
  got, plan = _TreeEstimate(lingvo_lm)
  # The training step as the task builds it on the run's 2 devices:
  # forward, backward, the optimizer's update, its functions' bodies.
  task = planner_testlib.BuildTask(lingvo_lm, 2, 2, train=True)
  built = tree_memory.BuiltNodes(task.train_op.graph)
  assert got.rss_terms['graph'] == built * _CONSTANTS.bytes_per_op
  # Lingvo's task code makes more nodes than the planner's count of its
  # cells predicts (memory_model.GraphNodes of the pipeline alone, and with
  # the task's other ops: the estimate before it read the built graph).
  mem = tree_memory.ProfileTaskMemory(lingvo_lm)
  (pipe,) = mem.pipes
  cells = memory_model.GraphNodes(pipe.profile, plan)
  before = start_memory._TreeEstimate(mem, 2, 2, _CONSTANTS)  # pylint: disable=protected-access
  before = before.rss_terms['graph'] / _CONSTANTS.bytes_per_op
  # Measured: 15193 nodes built, 7410 predicted for the cells, 8242 with
  # the task's other ops.
  assert 14000 < built < 16500, built
  assert cells < before < 0.6 * built, (cells, before, built)


def testTheTrainerWarnsForLingvosLmBeforeItsBuild(lingvo_lm, monkeypatch,
                                                  capsys):
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.preflight import param_checks  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import trainer_flags  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(memory_check, 'AvailableBytes',
                      lambda: (64 << 10, "the cgroup's memory limit"))
  monkeypatch.setattr(memory_probe, 'Get', lambda n, force=False: _CONSTANTS)
  ops = len(tf.get_default_graph().get_operations())
  o = trainer_flags.Options(model=lingvo_lm_testlib.MODEL,
                            logdir='/nonexistent/x', run_locally='cpu',
                            num_cpu_devices=2, worker_split_size=2)
  error, _ = param_checks.Check(o)
  assert error is None
  lines = [l for l in capsys.readouterr().err.splitlines()
           if l.startswith('warning: the run')]
  assert len(lines) == 1, lines
  assert 'task.lm.stack.schedule=' in lines[0]
  assert "the cgroup's memory limit is 64 KB" in lines[0]
  assert len(tf.get_default_graph().get_operations()) == ops


flagship = pytest.fixture(scope='module', name='flagship')(
    flagship_testlib.Fixture)


def testTheFlagshipsEstimateSizesItsBucketedTimeAxis(flagship):
  del flagship
  cfg = experiment_params.GetParams(flagship_testlib.MODEL, 'Train')
  # Graph nodes not counted (the graph term's own test is the LM's, above).
  got, plan = _TreeEstimate(cfg, constants=_NO_GRAPH)
  (pipe,) = tree_memory.ProfileTaskMemory(cfg).pipes
  # Its one Train bucket bounds the time axis the task trims at run time;
  # cell 1 gives the logits, [T, vocab] float32 per example.
  longest = max(cfg.input.bucket_upper_bound)
  assert pipe.profile.layers[-1].out_bytes == (
      longest * flagship_testlib.VOCAB_SIZE * 4)
  line = start_memory.StartWarning(cfg, 2, 2, '', got.rss_bytes - 1, 'x',
                                   _NO_GRAPH)
  assert 'task.lm.stack.schedule=' in line, line
  # Its record input's shuffle buffer is a term: all the records of its
  # small Train files (file_buffer_size 10,000,000), as input_memory says.
  from lingvo_ext.planner import input_memory  # pylint: disable=g-import-not-at-top
  buffered = input_memory.BufferBytes(cfg.input)
  assert buffered > 0
  assert got.rss_terms['input_buffer'] == buffered
  assert got.rss_bytes == sum(got.rss_terms.values())


def testTheOverrideNamedForABigBatchCountsWhatRecomputeHolds():
  # lm.TransformerLmGPipe at batch 512 (docs/faults.md's example): the
  # override is re-estimated by the same model, its recompute terms
  # included, and fits; the need its line names is the estimate's total.
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  over = 'input.batch_size:512'
  cfg = planner.ExperimentParams('lm.TransformerLmGPipe', overrides=over)
  got = start_memory.EstimateRun(cfg, 2, 2, _CONSTANTS)
  assert got.rss_bytes == sum(got.rss_terms.values())
  limit = got.rss_bytes / 3
  line = start_memory.StartWarning(cfg, 2, 2, over, limit, 'x', _CONSTANTS)
  size = start_memory.task_health.FormatBytes
  assert line.startswith(f'warning: the run needs about '
                         f'{size(got.rss_bytes)} ('), line
  override = re.search(r"--model_params_override='([^']*)'\.$", line)[1]
  fixed = planner.ExperimentParams('lm.TransformerLmGPipe',
                                   overrides=override)
  after = start_memory.EstimateRun(fixed, 2, 2, _CONSTANTS)
  assert after.rss_bytes <= limit
  assert f'(about {size(after.rss_bytes)})' in line
  assert start_memory.StartWarning(fixed, 2, 2, override, limit, 'x',
                                   _CONSTANTS) is None
  # Recompute at the same micro-batches holds its outputs and gradients.
  rc = planner.ExperimentParams(
      'lm.TransformerLmGPipe',
      overrides=over + '; task.recompute:True; task.num_micro_batches:32')
  terms = start_memory.EstimateRun(rc, 2, 2, _CONSTANTS).rss_terms
  assert terms['recompute_outputs'] > 0 and terms['gradient_buffers'] > 0


def testTheLauncherWarnsOncePerWorkerBeforeAnyTaskStarts(monkeypatch,
                                                         capfd):
  from lingvo_ext import launch  # pylint: disable=g-import-not-at-top
  from lingvo_ext.distributed import launching  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(memory_check, 'AvailableBytes',
                      lambda: (2 * 2**20, "the cgroup's memory limit"))
  monkeypatch.setattr(memory_probe, 'Get', lambda n, force=False: _CONSTANTS)
  started = []

  def Launch(*args, **kwargs):
    del args, kwargs
    started.append(capfd.readouterr().err)
    return 0

  monkeypatch.setattr(launching, 'Launch', Launch)
  assert launch.Main(['--model=lm.TransformerLmTinyGPipe',
                      '--logdir=/nonexistent/x', '--workers=2',
                      '--worker_split_size=2', '--num_cpu_devices=2']) == 0
  (err,) = started
  lines = [l for l in err.splitlines() if 'warning: the run needs' in l]
  # Each worker holds a replica's 2 cells on its 2 devices: the local
  # trainer's estimate there, against half of what the launcher may use.
  want = start_memory.StartWarning(
      experiment_params.GetParams('lm.TransformerLmTinyGPipe', 'Train'), 2, 2,
      '', 2**20, "the cgroup's memory limit over 2 worker tasks", _CONSTANTS)
  assert lines == [f'[worker0] {want}', f'[worker1] {want}'], err
