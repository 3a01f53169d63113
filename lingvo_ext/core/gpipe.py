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
"""

import copy

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import builder_layers
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_ext.core import cost as cost_lib
from lingvo_ext.core import cut_checkpoints
from lingvo_ext.core import cuts
from lingvo_ext.core import jit_choice
from lingvo_ext.core import nest_util
from lingvo_ext.core import partitioning
from lingvo_ext.core import schedules
from lingvo_ext.core.engine import kinds
from lingvo_ext.core.engine import records
from lingvo_ext.core.engine import recurrent
from lingvo_ext.core import stacking


# lingvo.core.gpipe's public hooks (stateless random ops in a cell seed from
# the micro-batch index, not the global step), so that code written against
# Lingvo's module runs with only the import changed.
CellFnFPropOpReplacementWrapper = (
    lingvo_gpipe.CellFnFPropOpReplacementWrapper)
SetOverWriteGlobalStep = lingvo_gpipe.SetOverWriteGlobalStep
GetOverWriteGlobalStep = lingvo_gpipe.GetOverWriteGlobalStep
GenerateStepSeedPair = lingvo_gpipe.GenerateStepSeedPair


def _LingvoOutputs(outputs):
  """Lingvo's pipeline output structure: a lone tensor bare, else a tuple."""
  if isinstance(outputs, py_utils.NestedMap):
    return outputs
  outputs = nest_util.ToTuple(outputs)
  return outputs[0] if len(outputs) == 1 else outputs


class FeatureExtractionLayer(base_layer.BaseLayer):
  """Runs a list of layers in sequence; the unit a pipeline cell is made of.

  It can also fetch the activations of named sub-layers (those that keep an
  `activation` attribute, e.g. `lingvo.core.layers.FetchLayer`) and append
  them to its outputs, after passing through `num_act_inputs` trailing inputs
  unchanged. That lets a later cell consume an earlier cell's activation.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('variable_name_prefix', '',
             'Prefix for variable names in sub layers.')
    p.Define('sub', [], 'A list of layers\' params, run in order.')
    p.Define('num_act_inputs', 0,
             'Number of trailing inputs that are activations passed through '
             'to the outputs untouched.')
    p.Define('num_act_outputs', 0,
             'Number of trailing activation outputs; must equal '
             'num_act_inputs + len(act_fetch_layers).')
    p.Define('act_fetch_layers', [],
             'Names of sub layers whose cached `activation` is appended to '
             'the outputs.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    p.act_fetch_layers = p.act_fetch_layers or []
    if p.num_act_inputs < 0 or p.num_act_outputs < 0:
      raise ValueError(
          '%s: num_act_inputs=%d and num_act_outputs=%d must be >= 0.' %
          (p.name, p.num_act_inputs, p.num_act_outputs))
    if p.num_act_outputs != p.num_act_inputs + len(p.act_fetch_layers):
      raise ValueError(
          '%s: num_act_outputs=%d must equal num_act_inputs (%d) + '
          'len(act_fetch_layers) (%d); set num_act_outputs=%d.' %
          (p.name, p.num_act_outputs, p.num_act_inputs,
           len(p.act_fetch_layers),
           p.num_act_inputs + len(p.act_fetch_layers)))
    sub_names = [sub.name for sub in p.sub]
    for sub in p.sub:
      if not sub.name:
        raise ValueError('%s: every layer in `sub` needs a name.' % p.name)
    for fetch in p.act_fetch_layers:
      if fetch not in sub_names:
        raise ValueError(
            '%s: act_fetch_layers names %r, which is not in sub (%s).' %
            (p.name, fetch, sub_names))
    self._seq = []
    for sub in p.sub:
      sub.name = p.variable_name_prefix + sub.name
      self.CreateChild(sub.name, sub)
      self._seq.append((sub.name, self.children[sub.name]))

  def FProp(self, theta, *args):
    p = self.params
    if len(args) <= p.num_act_inputs:
      raise ValueError(
          '%s: got %d inputs but num_act_inputs=%d; it needs at least one '
          'non-activation input.' % (p.name, len(args), p.num_act_inputs))
    out_args = args[:-p.num_act_inputs] if p.num_act_inputs > 0 else args
    extra_args = args[-p.num_act_inputs:] if p.num_act_inputs > 0 else ()
    for (name, ch) in self._seq:
      out_args = ch.FProp(theta[name], *nest_util.ToTuple(out_args))
    for fetch_layer in p.act_fetch_layers:
      activation = self.children[p.variable_name_prefix + fetch_layer]
      activation = activation.activation
      if isinstance(activation, (tuple, list)):
        activation = activation[0]
      extra_args += (activation,)
    if extra_args:
      out_args = nest_util.ToTuple(out_args) + extra_args
    return out_args

  @classmethod
  def FPropMeta(cls, p, *args):
    if len(args) <= p.num_act_inputs:
      raise ValueError('%s: FPropMeta got %d input shapes but '
                       'num_act_inputs=%d.' %
                       (p.name, len(args), p.num_act_inputs))
    seq_args = args[:-p.num_act_inputs] if p.num_act_inputs > 0 else args
    extra_args = args[-p.num_act_inputs:] if p.num_act_inputs > 0 else ()
    total = 0
    act_fetch_metas = {}
    for sub in p.sub:
      meta = sub.cls.FPropMeta(sub, *seq_args)
      if sub.name in p.act_fetch_layers:
        act_fetch_metas[sub.name] = meta.out_shapes[0]
      total += meta.flops
      seq_args = nest_util.ToTuple(meta.out_shapes)
    for fetch_layer in p.act_fetch_layers or []:
      extra_args += (act_fetch_metas[fetch_layer],)
    return py_utils.NestedMap(flops=total, out_shapes=seq_args + extra_args)


def FlattenSequentialLayers(params):
  """Flattens nested SequentialLayer/FeatureExtractionLayer params, in order.

  `repeat` of a SequentialLayer is expanded. The returned params are copies.

  Args:
    params: A layer's params, or a list of them.

  Returns:
    A list of leaf layer params.
  """
  if isinstance(params, (list, tuple)):
    return [s for p in params for s in FlattenSequentialLayers(p)]
  if params.cls is builder_layers.SequentialLayer:
    return [s for _ in range(params.repeat)
            for s in FlattenSequentialLayers(params.sub)]
  if params.cls in (FeatureExtractionLayer, lingvo_gpipe.FeatureExtractionLayer):
    if params.act_fetch_layers or params.num_act_inputs:
      # Splitting it would lose the activation plumbing; keep it whole.
      return [params.Copy()]
    return FlattenSequentialLayers(params.sub)
  return [params.Copy()]


def PartitionSequentialLayers(params, num_partitions, *shapes, cost='flops',
                              cut='exact', keep_layer_names=False,
                              **cost_kwargs):
  """Cuts a sequence of layers into cells of least possible bottleneck cost.

  Args:
    params: A layer's params or a list of them. Nested SequentialLayer and
      FeatureExtractionLayer params are flattened (expanding `repeat`).
    num_partitions: The number of cells, at most the number of leaf layers.
    *shapes: `tshape.Shape`s of the inputs to the first layer (one or more).
    cost: What to balance: 'flops' (FPropMeta forward FLOPs, the default),
      'params' (parameter bytes) or 'time' (measured forward+backward time).
      See `lingvo_ext.core.cost.LayerCosts`.
    cut: 'exact' (the default): the cut of least bottleneck cost, never an
      empty cell. 'lingvo': lingvo.core.gpipe.PartitionSequentialLayers'
      heuristic cut (cost 'flops'), with its flattening (a list's items are
      not expanded), so the cells, and with keep_layer_names=False the
      variable names, are Lingvo's byte for byte (some cells may be empty).
      A checkpoint restores across the two cuts anyway (`CheckpointVarMap`,
      and the trainer by itself).
    keep_layer_names: False (the default, Lingvo's naming): leaf layers are
      renamed 'cell_%03d' by global index. True: they keep the names the
      user gave them (a name used by several leaves gets its occurrence as a
      suffix, 'layer_0', 'layer_1'; an empty one is 'cell_NNN').
    **cost_kwargs: Passed to `LayerCosts` (e.g. the device for 'time').

  Returns:
    A list of `num_partitions` FeatureExtractionLayer params named 'd0',
    'd1', ... With `partition_independent_names=True` on the SeqLayer or
    PipeliningLayer, variable names then do not depend on the cut. Each cell
    records its leaves' global names (`cell_NNN`) and the user's names in
    params `leaf_global_names` and `leaf_user_names` (see
    lingvo_ext/core/cuts.py), so messages say `block3 (cell_005)` in both
    namings and checkpoints move between them.

  Raises:
    ValueError: no input shape, or a bad `num_partitions`, `cost` or `cut`.
  """
  if not shapes:
    raise ValueError('PartitionSequentialLayers needs the input shapes of the '
                     'first layer as *shapes (tshape.Shape).')
  if cut not in cuts.CUTS:
    raise ValueError('PartitionSequentialLayers: cut=%r; use one of %s.' %
                     (cut, ', '.join(cuts.CUTS)))
  if cut == 'lingvo' and cost != 'flops':
    raise ValueError("PartitionSequentialLayers: cut='lingvo' balances "
                     "FPropMeta FLOPs as Lingvo does; cost=%r needs "
                     "cut='exact'." % (cost,))
  if cut == 'lingvo':
    subs = cuts.LingvoFlatten(params)
  else:
    subs = FlattenSequentialLayers(params)
  if not subs:
    raise ValueError('PartitionSequentialLayers got no layers in `params`.')
  if not isinstance(num_partitions, int) or num_partitions < 1:
    raise ValueError('num_partitions=%r must be an int >= 1.' %
                     (num_partitions,))
  if cut == 'exact' and num_partitions > len(subs):
    raise ValueError(
        'num_partitions=%d but the stack has only %d layers; use '
        'num_partitions <= %d.' % (num_partitions, len(subs), len(subs)))
  names, global_names, user_names = cuts.LeafNames(subs, keep_layer_names)
  if cut == 'lingvo':
    sizes, costs = cuts.LingvoCut(subs, num_partitions, *shapes)
  else:
    costs = cost_lib.LayerCosts(subs, *shapes, cost=cost, **cost_kwargs)
    sizes = partitioning.MinMaxPartition(costs, num_partitions)
  for s, name in zip(subs, names):
    s.name = name
  total = float(sum(costs)) or 1.0
  seqs, start = [], 0
  for i, size in enumerate(sizes):
    part = subs[start:start + size]
    tf.logging.info('Partition %d: %d layers, %s cost %.3f of total', i, size,
                    cost, sum(costs[start:start + size]) / total)
    if not part:
      tf.logging.warning(
          "PartitionSequentialLayers(cut='lingvo'): cell d%d is empty, as in "
          "Lingvo's cut; cut='exact' never leaves a cell empty.", i)
    cell = FeatureExtractionLayer.Params().Set(name='d%d' % i, sub=part)
    cuts.RecordLeaves(cell, global_names[start:start + size],
                      user_names[start:start + size])
    seqs.append(cell)
    start += size
  return seqs


def CheckpointVarMap(layer, checkpoint_path, variables=None):
  """{checkpoint key: variable} for tf.train.Saver(var_list=...), any cut.

  A checkpoint written under another cut of the same layers into cells
  (e.g. lingvo.core.gpipe's), or the other naming, restores into `layer`.
  See `lingvo_ext.core.cut_checkpoints.CheckpointVarMap`.
  """
  return cut_checkpoints.CheckpointVarMap(layer, checkpoint_path, variables)


def CellVariableDevices(cluster, num_cells: int,
                        placement: str = 'round_robin') -> list:
  """The device of each cell's variables: the one that runs it in replica 0.

  Only where variables live on the worker devices (the ps devices are the
  worker devices, as in Lingvo's sync mode) and a split has several devices;
  otherwise '' for every cell (the enclosing placer decides). It reads only
  the cluster's worker and ps specs, which every job (controller, trainer,
  evaler) builds alike, so their graphs agree on each variable's device.

  Args:
    cluster: A Lingvo cluster.
    num_cells: The number of cells.
    placement: How cells sit on the split's devices (`kinds.PLACEMENTS`).

  Returns:
    A list of `num_cells` device strings.
  """
  cp = cluster.params
  per_split = cp.worker.devices_per_split
  if num_cells < 2 or per_split < 2:
    return [''] * num_cells
  workers = cluster.ListDevices(cp.worker).flatten().tolist()
  ps = cluster.ListDevices(cp.ps).flatten().tolist()
  if (not all(workers) or len(workers) < per_split or
      sorted(ps) != sorted(workers)):
    return [''] * num_cells
  return [workers[kinds.PlaceStage(placement, per_split, i)]
          for i in range(num_cells)]


class SeqLayer(base_layer.BaseLayer):
  """Runs `before_tpl`, then each cell of `cell_tpl` on its own device.

  Cell i runs on `cluster.WorkerDeviceInModelSplit(i)`, which wraps round-robin
  when there are more cells than devices in the split. As in Lingvo, this
  layer's own name is not in its children's variable names, the cells' are:
  `<parent scope>/<cell>/<sub-layer>/...`, e.g. `model/d0/cell_000/w/var`.
  With `partition_independent_names=True` the FeatureExtractionLayer cells'
  scope is dropped too (`model/cell_000/w/var`), so names do not depend on
  how the stack was partitioned.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('before_tpl', [],
             'Layers run on the first device before the cells.')
    p.Define('cell_tpl', [], 'A list of FeatureExtractionLayer params.')
    p.Define(
        'partition_independent_names', False,
        'False: lingvo.core.gpipe\'s variable names (d0/cell_000/w). True: '
        'no cell scope (cell_000/w), so a checkpoint restores under any '
        'partitioning. See docs/checkpoints.md.')
    p.Define(
        'colocate_cell_variables', True,
        'If True, each cell\'s variables live on the device that runs the '
        'cell; False leaves them to the enclosing placer, as '
        'lingvo.core.gpipe does. See docs/clusters.md.')
    p.Define(
        'stack_variables', False,
        'If True, same-shape variables of the layers in a cell are one '
        '[n, ...] variable; checkpoints keep per-layer names. See '
        'docs/performance.md.')
    p.Define(
        'max_combined_variable_size',
        stacking.DEFAULT_MAX_COMBINED_VARIABLE_SIZE,
        'stack_variables=True: the largest stacked variable, in bytes; '
        'bigger groups are split.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not p.cell_tpl:
      raise ValueError(
          '%s: cell_tpl is empty; give it a list of FeatureExtractionLayer '
          'params, e.g. from PartitionSequentialLayers(layers, '
          'num_partitions, *input_shapes).' % p.name)
    if p.partition_independent_names:
      self._CheckUniqueSubLayerNames()
    self._before_layers = []
    self._cells = []
    before_tpl_device = ''
    cell_devices = [''] * len(p.cell_tpl)
    # Where the schedule places each cell (PipeliningLayer's records).
    record = records.BY_NAME.get(p.schedule) if 'schedule' in p else None
    placement = record.placement if record else 'round_robin'
    if py_utils.use_tpu():
      before_tpl_device = self.cluster.WorkerDeviceInModelSplit(0)
      per_split = self.cluster.num_devices_per_split
      cell_devices = [
          self.cluster.WorkerDeviceInModelSplit(
              kinds.PlaceStage(placement, per_split, i))
          for i in range(len(p.cell_tpl))
      ]
    elif p.colocate_cell_variables:
      cell_devices = CellVariableDevices(self.cluster, len(p.cell_tpl),
                                         placement)
      before_tpl_device = cell_devices[0]
    for l in p.before_tpl:
      with tf.device(before_tpl_device):
        self.CreateChild(l.name, l)
      self._before_layers.append((l.name, self.children[l.name]))
    cell_tpl = p.cell_tpl
    if p.partition_independent_names:
      cell_tpl = [self._WithoutCellScope(l) for l in cell_tpl]
    stacker = None
    if p.stack_variables:
      stacker = stacking.VariableStacker(p.max_combined_variable_size)
    for i, l in enumerate(cell_tpl):
      with tf.device(cell_devices[i]):
        if stacker:
          with stacker.Record():
            self.CreateChild(l.name, l)
          # One stacked variable per group in each cell, so per device.
          for key, var in stacker.Stack(self.children[l.name], l.name).items():
            self._private_vars[key] = var
            self._private_theta[key] = var
        else:
          self.CreateChild(l.name, l)
      self._cells.append((l.name, self.children[l.name]))

  @staticmethod
  def _DropsCellScope(cell_p):
    return cell_p.cls in (FeatureExtractionLayer,
                          lingvo_gpipe.FeatureExtractionLayer)

  def _CheckUniqueSubLayerNames(self):
    """With the cell scope dropped, sub-layer names must not collide."""
    p = self.params
    seen = {}
    for l in p.cell_tpl:
      if not self._DropsCellScope(l):
        continue  # Its variables keep the cell's scope.
      for sub in l.sub or []:
        name = l.variable_name_prefix + sub.name
        if name in seen:
          raise ValueError(
              '%s: cells %r and %r both have a sub-layer named %r; with '
              'partition_independent_names=True cell variables are named by '
              'sub-layer alone, so give them distinct names '
              '(PartitionSequentialLayers names them cell_000, ...) or set '
              'partition_independent_names=False.' %
              (p.name, seen[name], l.name, name))
        seen[name] = l.name

  def _WithoutCellScope(self, cell_p):
    """Names a cell's sub-layer variables as if the cell were not there.

    With neither this layer's nor the cell's scope in the names, a variable's
    name depends on its layer alone, not on how the stack was partitioned:
    the same model cut into 1 or K cells has the same variables, and a
    checkpoint restores under any partitioning.

    Args:
      cell_p: A cell's params.

    Returns:
      A copy of cell_p with child_variable_scope_override set for its subs.
    """
    if not self._DropsCellScope(cell_p):
      return cell_p
    cell_p = cell_p.Copy()
    overrides = dict(cell_p.child_variable_scope_override or {})
    for sub in cell_p.sub:
      overrides.setdefault(cell_p.variable_name_prefix + sub.name, [])
    cell_p.child_variable_scope_override = overrides
    return cell_p

  def _child_variable_scope_override(self):
    # As Lingvo: children sit in this layer's parent scope, not its own.
    p = self.params
    res = super()._child_variable_scope_override()
    for l in p.before_tpl + p.cell_tpl:
      res[l.name] = []
    return res

  def FProp(self, theta, *args):
    """Runs the before layers, then the cells in sequence on their devices.

    Args:
      theta: A NestedMap of this layer's and its children's weights.
      *args: Input tensors.

    Returns:
      The last cell's outputs.
    """
    for (name, l) in self._before_layers:
      args = l.FProp(theta[name], *nest_util.ToTuple(args))
    for i, (name, cell) in enumerate(self._cells):
      with tf.device(self.cluster.WorkerDeviceInModelSplit(i)):
        args = cell.FProp(theta[name], *nest_util.ToTuple(args))
    return args


class PipeliningLayer(SeqLayer):
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
        'jit_compile', False,
        "XLA-compile each cell (not 'recurrent'): True, False or 'auto' "
        '(the faster, timed once per model and machine, cached). Speed only: '
        'same dropout masks. See docs/performance.md.')
    p.Define(
        'flat_weight_matmuls', True,
        'Run [..., in] x [in, out] weight matmuls in the cells as one 2-D '
        'GEMM, forward and backward. See docs/performance.md.')
    p.Define(
        'recompute', None,
        "Recompute each cell's forward pass in its backward pass. None: the "
        "schedule's default; 'recurrent' always recomputes. See "
        'docs/schedules.md.')
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
    if p.num_micro_batches < 1:
      raise ValueError('%s: num_micro_batches=%r must be >= 1.' %
                       (p.name, p.num_micro_batches))
    if p.micro_batch_size is not None and p.micro_batch_size < 1:
      raise ValueError('%s: micro_batch_size=%r must be >= 1 or None.' %
                       (p.name, p.micro_batch_size))
    records.CheckName(p.schedule, p.name)
    jit_choice.CheckValue(p.name, p.jit_compile)
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
            'input a static batch size (e.g. tf.ensure_shape or a fixed-size '
            'input generator).' % (p.name, i, shape.as_list(), p.batch_dim))
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
      shapes = nest_util.ToTuple(cell.FPropMeta(cell.params, *shapes).out_shapes)
      state_shapes.append(shapes[0] if p.nested_map_fprop else shapes)
    return state_shapes

  def StateDtype(self, args):
    p = self.params
    if p.state_dtype:
      return p.state_dtype
    return [t for t in self._InputTensors(args) if t is not None][0].dtype

  def ToState(self, values):
    """Packs cell inputs/outputs into the NestedMap that StackedRecurrent uses."""
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
    outputs = copy.copy(args)
    for (name, l) in self._before_layers + self._cells:
      outputs = l.FProp(theta[name], *nest_util.ToTuple(outputs))
    return outputs

  def JitCompile(self) -> bool:
    """Whether cells compile with XLA ('auto' resolved at FProp)."""
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
    self._jit_compile = jit_choice.Resolve(self, args)
    with tf.device(self.Devices()[0]):
      inputs = nest_util.ToTuple(args)
      for (name, l) in self._before_layers:
        inputs = nest_util.ToTuple(l.FProp(theta[name], *inputs))
    if records.Get(p.schedule).static_shapes and not all(
        t.shape.is_fully_defined() for t in py_utils.Flatten(inputs)
        if t is not None):
      raise ValueError('%s: %s.' % (p.name, records.Refusal(
          p.schedule, len(self._cells), self.cluster.num_devices_per_split,
          num_micro, static_shapes=False)))
    return _LingvoOutputs(
        schedules.SCHEDULES[p.schedule](self, theta, inputs, num_micro))

