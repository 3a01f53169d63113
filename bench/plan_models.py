"""bench/plan.py's models beyond the shipped experiments.

- `fc` (width 512), `fc256`, `fc512`, `fc1024`: bench/pipeline.py's FC
  stack at those widths with its per-example loss, plain SGD (FcProfile,
  BuildFcStep), where the step is FLOPs, not per-op time: on two devices
  with a core each, two cells can beat one.
- `lingvo_lm`: the scaled-down copy of Lingvo's OneBWdsGPipeTransformer
  (tests/support/flagship_testlib.py, batch-major), a pipeline of Lingvo's
  task code (task.lm.stack), planned on the tree path with its cells as cut.
- `lingvo_mt`: the scaled-down GPipe Transformer NMT experiment on Lingvo's
  NmtInput (tests/support/mt_testlib.py), an encoder-decoder stack, likewise.

A tree model's sweep is every plan of its first pipeline with its cells as
cut, one replica; its references are tree_calibration.ReferencePlans; its
predicted peak RSS is the memory model's (planner/memory_model.py) with the
task's variables outside the pipeline added.
"""

import os
import re
import sys
import tempfile
from typing import Dict
from typing import List
from typing import Optional

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The FC benchmark's size (`fc`): large enough that FLOPs, not per-op
# overhead, dominate at M=1, small enough for a sweep of minutes.
FC_DEFAULT_WIDTH = 512
FC_WIDTHS = (256, 512, 1024)
FC_BATCH = 64
FC_MODEL = 'homogeneous'
LINGVO_LM = 'lingvo_lm'
LINGVO_MT = 'lingvo_mt'
# name -> (the test library that writes its data and module, its model).
TREE_MODELS = {LINGVO_LM: ('flagship_testlib', 'MODEL'),
               LINGVO_MT: ('mt_testlib', 'MODEL')}

_FC = re.compile(r'^fc(\d*)$')
_TREES: Dict[str, tuple] = {}
# The directories Tree wrote in this process (Cleanup removes them).
_ROOTS: List[str] = []


def FcWidth(model: str) -> Optional[int]:
  """The FC stack's width of `model` ('fc', 'fc256', ...), else None."""
  m = _FC.match(model)
  if not m:
    return None
  return int(m.group(1)) if m.group(1) else FC_DEFAULT_WIDTH


# --- The FC benchmark as a planner model (TF) ---------------------------------


def FcLayers(width: int = FC_DEFAULT_WIDTH):
  """bench/pipeline.py's FC stack with its per-example loss, and its shape."""
  from lingvo.core import tshape  # pylint: disable=g-import-not-at-top

  from bench import pipeline_step  # pylint: disable=g-import-not-at-top
  layers = pipeline_step.LayerParams(FC_MODEL, width)
  layers.append(pipeline_step.PerExampleLoss.Params().Set(name='loss'))
  shape = tshape.Shape([FC_BATCH, pipeline_step.Widths(FC_MODEL, width)[0]])
  return layers, shape


def FcProfile(model: str = 'fc'):
  """The FC benchmark: linear loss, plain SGD (no slots), its own loss op
  (a planner.ModelProfile)."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  width = FcWidth(model)
  layers, shape = FcLayers(width)
  return planner.ModelProfile(
      name=model, layers=tuple(planner.ProfileLayers(layers, shape)),
      batch=FC_BATCH, in_bytes=4. * width, optimizer_slots=0,
      linear_loss=True, loss_ops=2)


def FcSessionConfig(num_devices: int):
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  return tf.config_pb2.ConfigProto(
      device_count={'CPU': num_devices}, inter_op_parallelism_threads=2,
      intra_op_parallelism_threads=1)


def BuildFcStep(plan, width: int = FC_DEFAULT_WIDTH):
  """(session, train op) of the FC benchmark under `plan` (one replica).

  As bench/pipeline.py's Step: the cells of the exact FLOPs cut on the plan's
  devices, the per-example losses summed, tf.gradients, SGD; the step runs
  the updates and the loss.
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from bench import pipeline_step  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  py_utils.SetEagerMode(False)
  if plan.replicas != 1:
    raise ValueError('the FC benchmark runs one replica.')
  layers, shape = FcLayers(width)
  cells = gpipe.PartitionSequentialLayers(layers, plan.num_cells, shape)
  graph = tf.Graph()
  d = plan.devices_per_replica
  with graph.as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=d, split_size=d):
    tf.random.set_seed(1)
    py_utils.GetOrCreateGlobalStepVar()
    x = tf.constant(np.random.RandomState(0).randn(FC_BATCH, width),
                    dtype=tf.float32)
    params = dict(schedule=plan.schedule)
    if plan.jit_compile != 'auto':
      params['jit_compile'] = plan.jit_compile
    if plan.schedule not in records.ALWAYS_RECOMPUTE + (
        records.LINEAR_LOSS_ONLY):
      params['recompute'] = plan.recompute
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=plan.num_micro_batches,
        **params).Instantiate()
    loss = tf.reduce_sum(net.FPropDefaultTheta(x))
    variables = net.vars.Flatten()
    grads = tf.gradients(loss, variables, colocate_gradients_with_ops=True)
    # The step computes the loss, as a trainer's does: with a loss linear in
    # the outputs the gradients need no forward output, so a step that
    # fetched only the updates would prune the forward pass and recompute
    # would cost nothing.
    train = tf.group(*[tf.assign_sub(v, pipeline_step.LEARNING_RATE * g)
                       for v, g in zip(variables, grads)] + [loss])
    init = tf.global_variables_initializer()
  sess = tf.Session(graph=graph, config=FcSessionConfig(d))
  sess.run(init)
  return sess, train


def IsTree(model: str) -> bool:
  return model in TREE_MODELS


def Tree(model: str):
  """(registered name, params, pipes, other variables' bytes, optimizer
  slots) of a tree model, its data written once per process (TF)."""
  if model not in _TREES:
    import importlib  # pylint: disable=g-import-not-at-top
    if _REPO not in sys.path:
      sys.path.insert(0, _REPO)
    from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
    from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
    from lingvo_ext.planner import tree_memory  # pylint: disable=g-import-not-at-top
    lib_name, attr = TREE_MODELS[model]
    lib = importlib.import_module('tests.support.' + lib_name)
    root = tempfile.mkdtemp(prefix='bench_plan_%s_' % model)
    _ROOTS.append(root)
    lib.Write(root)
    lib.Register(root)
    name = getattr(lib, attr)
    cfg = planner.ExperimentParams(name)
    pipes = tree.ProfileTree(cfg, name)
    mem = tree_memory.ProfileTaskMemory(cfg)
    _TREES[model] = (name, cfg, pipes, mem.other_param_bytes,
                     mem.optimizer_slots)
  return _TREES[model]


def Cleanup() -> None:
  """Removes what Tree wrote in this process (its data and module: the
  model stays imported)."""
  import shutil  # pylint: disable=g-import-not-at-top
  while _ROOTS:
    shutil.rmtree(_ROOTS.pop(), ignore_errors=True)


def TreeSweep(profile, devices: int, static_shapes: bool = True,
              micro_batches=None) -> List:
  """Every plan of a pipeline that comes cut: its K cells, one replica."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  k = len(profile.layers)
  return [p for p in planner.Enumerate(
      profile, devices, sync_choices=('shared',), micro_batches=micro_batches,
      static_shapes=static_shapes) if p.num_cells == k and p.replicas == 1]


def TreeStep(model: str, plan):
  """(session, train op) of a tree model under `plan` (TF)."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  name, cfg, pipes, _, _ = Tree(model)
  return planner.BuildExperimentStep(
      name, plan, model_params=cfg,
      apply=lambda params, p: tree.ApplyTree(params, [(pipes[0], p)]))


def PredictedRss(model: str, profile, plan, constants) -> float:
  """The memory model's peak RSS of `plan` (a tree model's other variables,
  their gradients and slots added)."""
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  got = memory_model.Predict(profile, plan, constants)
  if IsTree(model):
    _, _, _, others, slots = Tree(model)
    for term, factor in (('variables', 1), ('gradients', 1),
                         ('optimizer_slots', slots)):
      got = memory_model.Extra(got, term, others * factor)
  return got.rss_bytes
