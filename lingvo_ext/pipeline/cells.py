"""The cell of a pipeline and the cutting of a layer stack into cells.

`FeatureExtractionLayer` runs a list of layers in sequence (one cell);
`PartitionSequentialLayers` cuts a stack into such cells, balanced by cost,
exactly or as Lingvo does. `lingvo_ext.core.gpipe` re-exports these names, as
Lingvo's module of that name has them.
"""

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import builder_layers
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils

from lingvo_ext.pipeline import cost as cost_lib
from lingvo_ext.pipeline import cut_checkpoints
from lingvo_ext.pipeline import cuts
from lingvo_ext.pipeline import nest_util
from lingvo_ext.pipeline import partitioning


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
  if params.cls in (FeatureExtractionLayer,
                    lingvo_gpipe.FeatureExtractionLayer):
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
      See `lingvo_ext.pipeline.cost.LayerCosts`.
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
    lingvo_ext/pipeline/cuts.py), so messages say `block3 (cell_005)` in both
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
  See `lingvo_ext.pipeline.cut_checkpoints.CheckpointVarMap`.
  """
  return cut_checkpoints.CheckpointVarMap(layer, checkpoint_path, variables)
