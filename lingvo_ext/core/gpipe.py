"""GPipe pipeline parallelism, parameter-compatible with `lingvo.core.gpipe`.

Reference: 'GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism', https://arxiv.org/abs/1811.06965.

The classes and `Define`d params are Lingvo's, with the same meaning, so a
model switches by changing its import. The differences:

- `PartitionSequentialLayers` is exact (`partitioning.MinMaxPartition`), takes
  several input shapes, a cost choice, and never returns an empty partition.
- Where Lingvo clamps `num_micro_batches` silently or fails with a bare
  assert, a `ValueError` names the parameter, the values and the fix.
- `SeqLayer.partition_independent_names=True` names cell variables without
  the cell scope, so a checkpoint restores under any partitioning.

By default variable names, outputs and random streams are Lingvo's, in every
schedule: a Lingvo checkpoint restores into the same model built here, and
the other way round.

This module holds `PipeliningLayer` and is the one users import: the cell
and the cut (`cells.py`) and `SeqLayer` (`seq_layer.py`) are re-exported.
"""

import copy
import functools

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_ext.core import jit_choice
from lingvo_ext.core import seq_layer
from lingvo_ext.pipeline import cells
from lingvo_ext.pipeline import gemm_rewrite
from lingvo_ext.pipeline import kinds
from lingvo_ext.pipeline import nest_util
from lingvo_ext.pipeline import records
from lingvo_ext.pipeline import recurrent
from lingvo_ext.pipeline import schedules

# lingvo.core.gpipe's public hooks (stateless random ops in a cell seed from
# the micro-batch index, not the global step), so that code written against
# Lingvo's module runs with only the import changed.
CellFnFPropOpReplacementWrapper = (
    lingvo_gpipe.CellFnFPropOpReplacementWrapper)
SetOverWriteGlobalStep = lingvo_gpipe.SetOverWriteGlobalStep
GetOverWriteGlobalStep = lingvo_gpipe.GetOverWriteGlobalStep
GenerateStepSeedPair = lingvo_gpipe.GenerateStepSeedPair

# The cell, the cut and the sequential layer live in modules of their own;
# these are the names Lingvo's gpipe (and users' code) hold.
FeatureExtractionLayer = cells.FeatureExtractionLayer
FlattenSequentialLayers = cells.FlattenSequentialLayers
PartitionSequentialLayers = cells.PartitionSequentialLayers
CheckpointVarMap = cells.CheckpointVarMap
CellVariableDevices = seq_layer.CellVariableDevices
SeqLayer = seq_layer.SeqLayer


# PipeliningLayer.check_numerics' values.
CHECK_NUMERICS = ('step', 'cells')


def _LingvoOutputs(outputs):
  """Lingvo's pipeline output structure: a lone tensor bare, else a tuple."""
  if isinstance(outputs, py_utils.NestedMap):
    return outputs
  outputs = nest_util.ToTuple(outputs)
  return outputs[0] if len(outputs) == 1 else outputs


class PipeliningLayer(seq_layer.SeqLayer):
  """Pipelines a sequence of cells over micro-batches on several devices.

  The batch is split into `num_micro_batches` along `batch_dim`; each cell
  runs on its device of the model split (as the schedule's record places
  it: cell i on device i, round robin, or in a V for 'zbv'), and micro-batch
  t+1 enters cell i while micro-batch t is in cell i+1. Gradients equal those
  of the sequential model.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_micro_batches', 1,
             'Number of micro-batches; must divide the batch size.')
    p.Define('micro_batch_size', None,
             'Size of a micro-batch. If set, the batch must be '
             'micro_batch_size * num_micro_batches.')
    p.Define('batch_dim', 0, 'The batch dimension of every input.')
    p.Define('state_dtype', None,
             "schedule='recurrent' only: dtype of the states passed between "
             'cells; defaults to the dtype of the first input.')
    p.Define('nested_map_fprop', False,
             'Whether cells take and return a single NestedMap.')
    p.Define('schedule', 'unrolled', records.ScheduleHelp())
    p.Define(
        'cell_functions', True,
        "If True, each cell is one TF function built once and called per "
        "micro-batch; False copies its ops per micro-batch (not for "
        "'recurrent'). See docs/schedules.md.")
    p.Define(
        'jit_compile', None,
        "XLA-compile each cell (not 'recurrent'): True, False, 'auto' (the "
        'faster, timed once per model and machine, cached) or None: False, '
        "or the trainer's --jit_compile. Speed only: same dropout masks. See "
        'docs/performance.md.')
    p.Define(
        'flat_weight_matmuls', True,
        'Run [..., in] x [in, out] weight matmuls in the cells and '
        'before_tpl layers as one 2-D GEMM, forward and backward. See '
        'docs/performance.md.')
    p.Define(
        'recompute', None,
        "Recompute each cell's forward pass in its backward pass. None: the "
        "schedule's default; 'recurrent' always recomputes. See "
        'docs/schedules.md.')
    p.Define(
        'check_numerics', 'step',
        "Lingvo's NaN/Inf checks: 'step' checks the pipeline's outputs and "
        "gradients once a step, 'cells' every cell's per micro-batch "
        "('recurrent' always). See docs/performance.md.")
    return p

  def __init__(self, params):
    p = params
    num_devices = cluster_factory.Current().num_devices_per_split
    if py_utils.use_tpu() and len(p.cell_tpl) > num_devices:
      # StackedRecurrent needs a distinct device per cell on TPU; Lingvo
      # stops here with a bare assert deep inside it.
      raise ValueError(
          '%s: %d cells in cell_tpl but the model split has %d TPU cores, '
          'and on TPU every cell needs its own. Partition into %d cells '
          '(PartitionSequentialLayers(..., num_partitions=%d)) or raise the '
          'split size (worker split_size / --worker_split_size).' %
          (p.name, len(p.cell_tpl), num_devices, num_devices, num_devices))
    super().__init__(params)
    p = self.params
    self._capture_hooks = []
    self._cell_hooks = []
    if p.num_micro_batches < 1:
      raise ValueError('%s: num_micro_batches=%r must be >= 1.' %
                       (p.name, p.num_micro_batches))
    if p.micro_batch_size is not None and p.micro_batch_size < 1:
      raise ValueError('%s: micro_batch_size=%r must be >= 1 or None.' %
                       (p.name, p.micro_batch_size))
    records.CheckName(p.schedule, p.name)
    jit_choice.CheckValue(p.name, p.jit_compile)
    if p.check_numerics not in CHECK_NUMERICS:
      raise ValueError("%s: check_numerics=%r: give 'step' (once a step) or "
                       "'cells' (every cell's, per micro-batch)." %
                       (p.name, p.check_numerics))
    error = records.RecomputeError(p.schedule, p.recompute, '')
    if error:
      raise ValueError('%s: %s' % (p.name, error))
    error = None
    if not (self.do_eval and num_devices == 1):  # Eval there: in sequence.
      error = records.Refusal(p.schedule, len(p.cell_tpl), num_devices,
                              p.num_micro_batches)
    if error:
      raise ValueError('%s: %s.' % (p.name, error))
    empty = [c.name for c in p.cell_tpl if 'sub' in c and not c.sub]
    if empty:
      # E.g. Lingvo's stacks with `splits` beyond their layers.
      raise ValueError(
          '%s: cells %s hold no layer (%d cells, more than the layers to '
          'cut); use fewer cells (splits).' %
          (p.name, ', '.join(empty), len(p.cell_tpl)))
    if (len(p.cell_tpl) > num_devices > 1 and
        records.Get(p.schedule).placement == 'round_robin'):
      tf.logging.warning(
          '%s: %d cells on %d devices; cells share devices round-robin and '
          'those run one after another.', p.name, len(p.cell_tpl),
          num_devices)

  def _InputTensors(self, args):
    p = self.params
    if p.nested_map_fprop:
      if len(args) != 1 or not isinstance(args[0], py_utils.NestedMap):
        raise ValueError('%s: nested_map_fprop=True takes exactly one '
                         'NestedMap input, got %r.' % (p.name, args))
      return py_utils.Flatten(args[0])
    return nest_util.ToTuple(args)

  def _MicroBatching(self, args):
    """Returns (batch size, micro-batch size, number of micro-batches)."""
    p = self.params
    batch = None
    for i, t in enumerate(self._InputTensors(args)):
      if t is None:
        continue
      shape = t.shape
      if shape.rank is None or shape.rank <= p.batch_dim:
        raise ValueError(
            '%s: input %d has shape %s without batch_dim=%d; set batch_dim '
            'to the batch dimension of every input.' %
            (p.name, i, shape, p.batch_dim))
      size = shape.as_list()[p.batch_dim]
      if size is None:
        raise ValueError(
            '%s: input %d has shape %s whose batch dimension (batch_dim=%d) '
            'is unknown; the pipeline splits the batch statically. Give the '
            'input a static batch size: Lingvo\'s NmtInput with '
            'pad_to_max_seq_length=True and equal bucket_batch_limit, '
            'LmInput with fixed_input_shape=True, or tf.ensure_shape in your '
            'input generator.' % (p.name, i, shape.as_list(), p.batch_dim))
      if batch is not None and size != batch:
        raise ValueError('%s: inputs have different batch sizes (%d and %d '
                         'along batch_dim=%d).' %
                         (p.name, batch, size, p.batch_dim))
      batch = size
    if batch is None:
      raise ValueError('%s: no input tensor to take the batch size from.' %
                       p.name)
    m = p.num_micro_batches
    if p.micro_batch_size:
      if p.micro_batch_size * m != batch:
        raise ValueError(
            '%s: micro_batch_size=%d * num_micro_batches=%d != batch size %d. '
            'Set micro_batch_size=None to derive it, or make the product '
            'equal the batch size.' % (p.name, p.micro_batch_size, m, batch))
      return batch, p.micro_batch_size, m
    if batch % m:
      divisors = [d for d in range(1, batch + 1) if batch % d == 0]
      raise ValueError(
          '%s: batch size %d (batch_dim=%d) is not divisible by '
          'num_micro_batches=%d. Use a num_micro_batches that divides it '
          '(%s) or change the batch size.' %
          (p.name, batch, p.batch_dim, m, divisors))
    return batch, batch // m, m

  def StateShapes(self, args, micro_batch_size, after_before_layers=False):
    """tshape.Shapes of the cells' inputs and outputs for one micro-batch.

    Args:
      args: The FProp inputs.
      micro_batch_size: The size of a micro-batch.
      after_before_layers: Whether `args` are the outputs of `before_tpl`
        (else its inputs).

    Returns:
      A list of K + 1 entries (K cells): for each, a tuple of tshape.Shape (or
      a NestedMap of them with nested_map_fprop).
    """
    p = self.params

    def _MicroShape(t):
      if t is None:
        return None
      shape = t.shape.as_list()
      shape[p.batch_dim] = micro_batch_size
      return tshape.Shape(shape)

    if p.nested_map_fprop:
      shapes = (py_utils.Transform(_MicroShape, args[0]),)
    else:
      shapes = tuple(_MicroShape(t) for t in nest_util.ToTuple(args))
    if not after_before_layers:
      for (_, l) in self._before_layers:
        shapes = nest_util.ToTuple(l.FPropMeta(l.params, *shapes).out_shapes)
    state_shapes = [shapes[0] if p.nested_map_fprop else shapes]
    for (_, cell) in self._cells:
      meta = cell.FPropMeta(cell.params, *shapes)
      shapes = nest_util.ToTuple(meta.out_shapes)
      state_shapes.append(shapes[0] if p.nested_map_fprop else shapes)
    return state_shapes

  def StateDtype(self, args):
    p = self.params
    if p.state_dtype:
      return p.state_dtype
    return [t for t in self._InputTensors(args) if t is not None][0].dtype

  def ToState(self, values):
    """Packs cell inputs/outputs into StackedRecurrent's NestedMap."""
    return recurrent.ToState(self.params.nested_map_fprop, values)

  def FromState(self, state, shapes, fn):
    """Inverse of ToState: applies fn(name, tshape) to each present entry."""
    return recurrent.FromState(self.params.nested_map_fprop, state, shapes, fn)

  def FPropSequential(self, theta, *args):
    """The same model without pipelining: every cell in turn, whole batch.

    It is what eval runs on a single device, and the reference the pipeline
    must match.

    Args:
      theta: A NestedMap of this layer's and its children's weights.
      *args: Input tensors.

    Returns:
      The last cell's outputs.
    """
    for hook in self._capture_hooks:
      hook(theta, args)
    cells = dict(self._cells)
    outputs = copy.copy(args)
    for (name, l) in self._before_layers + self._cells:
      fprop = l.FProp
      for hook in self._cell_hooks if name in cells else ():
        fprop = functools.partial(hook, name, fprop)
      outputs = fprop(theta[name], *nest_util.ToTuple(outputs))
    return outputs

  def AddCaptureHook(self, hook):
    """Calls `hook(theta, args)` with the inputs of each FPropSequential
    run of this instance (the planner reads a pipeline's inputs so)."""
    self._capture_hooks.append(hook)

  def AddCellHook(self, hook):
    """Runs each cell in FPropSequential as `hook(name, fprop, theta,
    *args)`, which calls `fprop(theta, *args)` and returns its outputs (the
    planner records a cell's forward ops so)."""
    self._cell_hooks.append(hook)

  def JitCompile(self) -> bool:
    """Whether cells compile with XLA (an 'auto' left to FProp: its cached
    choice, else False; runtime/jit_resolve.py resolves it before)."""
    return getattr(self, '_jit_compile', jit_choice.Normalize(
        self.params.name, self.params.jit_compile) is True)

  def Cells(self):
    """[(name, cell layer)] of the pipeline's cells, in order."""
    return list(self._cells)

  def Devices(self):
    """The device of each cell: Lingvo's model split, placed as the
    schedule's record says (round robin, or down and back up for 'zbv')."""
    placement = records.Get(self.params.schedule).placement
    num_devices = self.cluster.num_devices_per_split
    return [
        self.cluster.WorkerDeviceInModelSplit(
            kinds.PlaceStage(placement, num_devices, i))
        for i in range(len(self._cells))
    ]

  def MicroBatchSteps(self, num_micro, state_dtype):
    """Lingvo's per-micro-batch steps: global_step * num_micro + t."""
    # One read of the step and one vector for all micro-batches: a few ops
    # a step, not four per micro-batch.
    global_step = tf.convert_to_tensor(py_utils.GetGlobalStep())
    steps = global_step * num_micro + tf.range(num_micro,
                                               dtype=global_step.dtype)
    return tf.unstack(tf.cast(steps, dtype=state_dtype), num=num_micro)

  def FProp(self, theta, *args):
    """Runs the cells over micro-batches in a pipeline across devices.

    Args:
      theta: A NestedMap of this layer's and its children's weights.
      *args: Input tensors (or one NestedMap with nested_map_fprop), each with
        a static batch dimension `batch_dim`.

    Returns:
      The last cell's outputs for the whole batch, structured as Lingvo's
      PipeliningLayer returns them: one output as a bare tensor, several as a
      tuple, or a NestedMap. (On one device in eval, the cells run in
      sequence and their outputs come back as the last cell returns them, as
      in Lingvo.)
    """
    p = self.params
    if self.do_eval and self.cluster.num_devices_per_split == 1:
      return self.FPropSequential(theta, *args)

    _, _, num_micro = self._MicroBatching(args)
    self._jit_compile = jit_choice.AtBuild(self, args)  # Never measures.
    with tf.device(self.Devices()[0]):
      inputs = nest_util.ToTuple(args)
      for (name, l) in self._before_layers:
        # Run once on the whole batch; their weight matmuls as the cells'.
        inputs = nest_util.ToTuple(gemm_rewrite.Flattened(
            lambda l=l, x=inputs, name=name: l.FProp(theta[name], *x),
            p.flat_weight_matmuls))
    if records.Get(p.schedule).static_shapes and not all(
        t.shape.is_fully_defined() for t in py_utils.Flatten(inputs)
        if t is not None):
      raise ValueError('%s: %s.' % (p.name, records.Refusal(
          p.schedule, len(self._cells), self.cluster.num_devices_per_split,
          num_micro, static_shapes=False)))
    return _LingvoOutputs(
        schedules.SCHEDULES[p.schedule](self, theta, inputs, num_micro))

