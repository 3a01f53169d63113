"""A Lingvo task whose layer stack runs as a GPipe pipeline."""

import contextlib
import heapq

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import base_model
from lingvo.core import cluster_factory
from lingvo.core import py_utils

from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext.core import gpipe
from lingvo_ext.core import jit_choice
from lingvo_ext.core import precision
from lingvo_ext.core import stacking
from lingvo_ext.distributed import sync
from lingvo_ext.pipeline import records

# PipeliningLayer params that the task sets itself (from its layer stack and
# its own params), so they are not task params of their own.
_PIPELINE_PARAMS_SET_BY_TASK = frozenset([
    'name', 'cls', 'cell_tpl', 'before_tpl', 'nested_map_fprop', 'batch_dim',
    'micro_batch_size', 'state_dtype', 'num_micro_batches',
    'partition_independent_names', 'stack_variables',
    'max_combined_variable_size', 'colocate_cell_variables'
])


# Where a task's default differs from the layer's. None: jit_compile stays
# unset, so that the trainer's --jit_compile chooses it
# (runtime/jit_default.py); 'auto' here would time both builds at every
# first build of a model, a cost every short run and test would pay.
TASK_DEFAULTS = {}


def PipelineSwitches():
  """[(name, default, doc)]: the PipeliningLayer params a task passes through.

  Every param that PipeliningLayer defines beyond BaseLayer's, less those the
  task sets itself (_PIPELINE_PARAMS_SET_BY_TASK): `schedule`,
  `recompute`, `cell_functions` and `jit_compile`; a param the engine adds
  later becomes a task param too.
  """
  layer = gpipe.PipeliningLayer.Params()
  base = base_layer.BaseLayer.Params()
  return [(name, value, internal_lingvo.ParamDescription(layer, name))
          for name, value in layer.IterParams()
          if name not in base and name not in _PIPELINE_PARAMS_SET_BY_TASK]


class PipelinedTask(base_model.BaseTask):
  """Cuts the stack from `LayerStack` into cells and pipelines them.

  Subclasses define `LayerStack(task_params)`; the pipeline is the child
  `pipeline`, to be run in `ComputePredictions`.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'num_partitions', 1, 'Number of pipeline cells K the stack is cut '
        'into. To run them in parallel, give the worker K devices '
        '(--worker_split_size=K, with --num_cpu_devices=K on CPU).')
    p.Define(
        'num_micro_batches', 1, 'Micro-batches per batch in the pipeline; '
        'must divide the input batch_size.')
    p.Define(
        'partition_cost', 'flops', 'What PartitionSequentialLayers balances: '
        'flops, params or time.')
    p.Define(
        'partition_independent_names', True,
        'True: cell variables have no cell scope, so a checkpoint restores at '
        'any num_partitions; False: lingvo.core.gpipe\'s names (convert with '
        '`.venv/bin/python -m lingvo_ext.tools.convert_checkpoint`).')
    p.Define(
        'keep_layer_names', True,
        'True: LayerStack\'s layers keep their names in variable names '
        '(lm/softmax/w/var); False: cell_000, cell_001, ... as Lingvo names '
        'them. See docs/checkpoints.md.')
    p.Define(
        'stack_variables', False,
        'Stack the same-shape variables of each cell\'s layers into one per '
        'group (and their optimizer slots); checkpoints keep per-layer '
        'names. See docs/performance.md.')
    p.Define(
        'max_combined_variable_size',
        stacking.DEFAULT_MAX_COMBINED_VARIABLE_SIZE,
        'stack_variables=True: the largest stacked variable, in bytes; '
        'bigger groups are split.')
    p.Define(
        'gradient_sync', 'shared',
        'How data-parallel replicas synchronise gradients: "shared" '
        '(Lingvo\'s), "all_reduce", "parameter_server" or "hybrid". See '
        'docs/clusters.md.')
    p.Define(
        'accumulate_steps', 1, 'Apply one update every N steps from the mean '
        'of their gradients: the update of an N-times larger batch (clipped '
        'after accumulation). Works with every gradient_sync.')
    p.Define(
        'gradient_compression', 'none', '"fp16": all-reduce dense gradients '
        'as float16 (gradient_sync all_reduce or hybrid); "none": as they are.')
    p.Define(
        'ps_placement', 'size', 'gradient_sync parameter_server or hybrid: '
        'how variables are spread over the ps devices, "size" (least loaded '
        'in bytes) or "round_robin".')
    for name, default, doc in PipelineSwitches():
      p.Define(name, TASK_DEFAULTS.get(name, default),
               f"Passed to the PipeliningLayer ('task.{name}:...'): {doc}")
    # BaseLayer's own param, documented for this task's users.
    internal_lingvo.SetParamDescription(p, 'fprop_dtype', (
        'The dtype the layers compute in: None or float32 (the default), or '
        'bfloat16 (Lingvo\'s mixed precision: variables, optimizer and '
        'checkpoints stay float32). See docs/performance.md.'))
    p.train.clip_gradient_norm_to_value = 1.0
    return p

  @classmethod
  def CheckParams(cls, task_params):
    """Raises ValueError for bad pipeline switches, before building a graph.

    The trainer calls it on the overridden params, so a bad value is one
    line before anything is written to the logdir.
    """
    p = task_params
    precision.ParseDtype(p.fprop_dtype, f'{p.name}: task.fprop_dtype')
    records.CheckName(p.schedule, p.name, 'task.schedule', 'task.schedule')
    if p.recompute not in (None, True, False):
      raise ValueError(f'{p.name}: task.recompute={p.recompute!r}; use None, '
                       'True or False.')
    error = records.RecomputeError(p.schedule, p.recompute, 'task.')
    if error:
      raise ValueError(f'{p.name}: {error}')
    if not isinstance(p.num_micro_batches, int) or p.num_micro_batches < 1:
      raise ValueError(f'{p.name}: task.num_micro_batches='
                       f'{p.num_micro_batches!r} must be an int >= 1.')
    if not isinstance(p.num_partitions, int) or p.num_partitions < 1:
      raise ValueError(f'{p.name}: task.num_partitions={p.num_partitions!r} '
                       'must be an int >= 1.')
    sync.CheckParams(p.name, p.gradient_sync, p.accumulate_steps,
                     p.gradient_compression, p.ps_placement)

  @classmethod
  def _CheckHasInput(cls, task_params):
    """LayerStack needs the input's batch shape; say where to get it."""
    if task_params.input is None:
      raise ValueError(
          f'{task_params.name}: task params have no input; LayerStack needs '
          'the input batch shape. Pass '
          'model_registry.GetParams(name, "Train").task.')

  @classmethod
  def LayerStack(cls, task_params):
    """The flat layer stack and the input shapes of one training batch.

    Args:
      task_params: This task's params, with `input` set (e.g.
        `model_registry.GetParams(name, 'Train').task`).

    Returns:
      (list of layer params, tuple of tshape.Shape), the arguments the task
      gives `PartitionSequentialLayers`.
    """
    raise NotImplementedError(cls.__name__)

  def _PipelineParams(self):
    """The PipeliningLayer params; subclasses may adjust them."""
    p = self.params
    stack, shapes = self.LayerStack(p)
    cells = gpipe.PartitionSequentialLayers(
        stack, p.num_partitions, *shapes, cost=p.partition_cost,
        keep_layer_names=p.keep_layer_names)
    switches = {name: p.Get(name) for name, _, _ in PipelineSwitches()}
    # An override of the 'auto' default parses True/False as text.
    switches['jit_compile'] = jit_choice.Normalize(
        f'{p.name}: task', switches['jit_compile'])
    return gpipe.PipeliningLayer.Params().Set(**switches).Set(
        name='pipeline', cell_tpl=cells,
        num_micro_batches=p.num_micro_batches,
        partition_independent_names=p.partition_independent_names,
        stack_variables=p.stack_variables,
        max_combined_variable_size=p.max_combined_variable_size,
        # The ps strategies place variables on the ps devices themselves.
        colocate_cell_variables=p.gradient_sync not in ('parameter_server',
                                                        'hybrid'))

  def __init__(self, params):
    # Its learners apply through the GradientSync made below, if any, and
    # clip by the norm of the gradients with duplicate rows summed, so that
    # every schedule clips alike (SyncLearnerMixin.ScaleGradients).
    params = sync.WithSyncLearners(params)
    # An override gives the dtype as text ('bfloat16'); Lingvo's layers take
    # a tf.DType, which the children then copy (BaseLayer.CopyBaseParams).
    params = params.Copy()
    params.fprop_dtype = precision.ParseDtype(
        params.fprop_dtype, f'{params.name}: task.fprop_dtype')
    super().__init__(params)
    p = self.params
    if p.stack_variables:
      for lp in self._LearnerParams():
        if lp.bprop_variable_filter or lp.bprop_variable_exclusion:
          raise ValueError(
              f'{p.name}: stack_variables=True with learner {lp.name!r} '
              'selecting variables by name (bprop_variable_filter / '
              'bprop_variable_exclusion): a stacked variable holds several '
              'layers\' variables under one name. Drop the filter or set '
              'task.stack_variables=False.')
    sync.CheckParams(p.name, p.gradient_sync, p.accumulate_steps,
                     p.gradient_compression, p.ps_placement)
    if p.stack_variables and p.gradient_sync != 'shared':
      raise ValueError(
          f'{p.name}: stack_variables=True is not supported with '
          f'gradient_sync={p.gradient_sync!r} yet; set '
          'task.stack_variables=False or task.gradient_sync="shared".')
    self._sync = None
    # Evalers and decoders run one replica on the shared copy.
    training = not self.cluster.do_eval
    num_replicas = self.cluster.num_splits_per_client
    # The controller process of a multi-process cluster sees one split: it
    # only saves and restores the variables (replica 0's copies, placed as
    # the trainer client places them); the trainer client syncs.
    controller_only = (self.cluster.job == 'controller' and num_replicas == 1
                       and self.cluster.params.worker.replicas > 1)
    if training and not controller_only:
      sync.CheckReplicas(
          p.name, p.gradient_sync, num_replicas,
          self.cluster.num_devices_per_split,
          p.input.batch_size if p.input else p.num_micro_batches,
          p.num_micro_batches)
      if p.gradient_sync != 'shared' or p.accumulate_steps > 1:
        self._sync = sync.GradientSync(
            p.name, p.gradient_sync, num_replicas, p.accumulate_steps,
            p.gradient_compression)
    placer = contextlib.nullcontext()
    if training and p.gradient_sync in ('parameter_server', 'hybrid'):
      placer = tf.device(self._PsPlacer())
    with placer:
      self.CreateChild('pipeline', self._PipelineParams())

  @property
  def gradient_sync(self):
    """The GradientSync of a training task, or None (Lingvo's 'shared')."""
    return self._sync

  def _PsPlacer(self):
    """A device function placing variables on the ps devices."""
    devices = self.cluster.ListDevices(self.cluster.params.ps).flatten()
    devices = [d for d in devices.tolist() if d] or ['']
    load = [(0, i) for i in range(len(devices))]
    turn = [0]

    def Place(op):
      if op.device or op.type not in ('VarHandleOp', 'VariableV2'):
        return op.device
      if self.params.ps_placement == 'round_robin':
        i = turn[0] % len(devices)
        turn[0] += 1
        return devices[i]
      size = tf.TensorShape(op.get_attr('shape')).num_elements() or 1
      allocated, i = heapq.heappop(load)
      heapq.heappush(load, (allocated + size * op.get_attr('dtype').size, i))
      return devices[i]

    return Place

  def _VariableStage(self, path):
    """The pipeline stage (cell index) whose device reads variable `path`."""
    parts = path.split('.')
    if len(parts) > 1 and parts[0] == 'pipeline':
      names = [name for name, _ in internal_lingvo.SeqCells(self.pipeline)]
      if parts[1] in names:
        return names.index(parts[1])
    return 0

  def _FPropSplitInputBatch(self, theta, input_batch):
    """Lingvo's tower loop, each replica reading the copies of its strategy."""
    if self._sync is None or self.params.gradient_sync == 'shared':
      return super()._FPropSplitInputBatch(theta, input_batch)
    if not isinstance(input_batch, list):
      input_batch = [input_batch]
    all_metrics, all_per_example = [], []
    with self.cluster:
      for r, batch in enumerate(input_batch):
        with cluster_factory.SetModelSplit(r) as c:
          with tf.device(c.WorkerDeviceInModelSplit(0)):
            with tf.name_scope(f'replica_{r}'):
              theta_r = self._sync.ReplicaTheta(
                  r, theta, self.vars,
                  lambda path, c=c: c.WorkerDeviceInModelSplit(
                      self._VariableStage(path)), self._VariableStage)
              metrics, per_example = self.FPropTower(theta_r, batch)
        all_metrics.append(metrics)
        all_per_example.append(per_example)
    return (py_utils.WeightedAvgOfMetrics(all_metrics),
            py_utils.ConcatPerExampleTensors(all_per_example))

  def _BPropGenTrainOps(self, vmap, metrics=None, add_summary=True):
    if self._sync is None:
      return super()._BPropGenTrainOps(vmap, metrics, add_summary)
    # Lingvo's train ops (EMA, global step...); its learners (SyncLearners)
    # apply through the synchronised update.
    with sync.Applying(self._sync):
      return super()._BPropGenTrainOps(vmap, metrics, add_summary)

  def _LearnerParams(self):
    tp = self.params.train
    learners = tp.learner if tp.learner else []
    return learners if isinstance(learners, (list, tuple)) else [learners]

  def BProp(self):
    super().BProp()
    if self.params.stack_variables:
      # The optimizer has made its slots: give them per-layer names too.
      stacking.StackSlotVariables()
