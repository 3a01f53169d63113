"""The vocabulary layers: token/position embedding and the softmax, shardable.

Their tables can be cut into shards placed across devices (`partitioner`,
lingvo_ext/layers/sharding.py). The conventions of every layer here are in
`lingvo_ext.layers`.
"""

import math

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np

from lingvo_ext.layers import dense_layers
from lingvo_ext.layers import flops
from lingvo_ext.layers import layer_util
from lingvo_ext.layers import sharding

POSITION_EMBEDDINGS = ('LEARNED', 'SINUSOIDAL', 'NONE')


def SinusoidalPositionTable(length: int, dim: int) -> np.ndarray:
  """[length, dim] sin/cos position table of 'Attention Is All You Need'."""
  pos = np.arange(length, dtype=np.float64)[:, None]
  num_timescales = dim // 2
  log_inc = math.log(1.0e4) / max(num_timescales - 1, 1)
  inv = np.exp(np.arange(num_timescales, dtype=np.float64) * -log_inc)
  scaled = pos * inv[None, :]
  table = np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1)
  if dim % 2:
    table = np.pad(table, [[0, 0], [0, 1]])
  return table.astype(np.float32)


_PARTITIONER_DOC = (
    'None: one variable. Else a TF partitioner and its arguments, e.g. '
    "('fixed_size', dict(num_shards=4)) "
    '(tf.compat.v1.fixed_size_partitioner), '
    "('min_max', dict(max_partitions=8, min_slice_size=256 << 10)) "
    '(tf.compat.v1.min_max_variable_partitioner) or '
    "('variable_axis_size', dict(max_shard_bytes=64 << 20)) "
    '(tf.compat.v1.variable_axis_size_partitioner); the layer picks the '
    'axis. Shard i is placed on device i mod P of the cluster\'s ps job '
    '(ps tasks; in a local run, the --num_cpu_devices CPUs), or, with a '
    'one-device ps job, on device i mod S of the model split (see '
    'lingvo_ext/layers/sharding.py). Checkpoints restore into any other '
    'partitioning (TF saved slices) when partition_strategy is div.')
_PARTITION_STRATEGY_DOC = (
    "How ids map to shards, as in tf.nn.embedding_lookup: 'div' (shard i "
    "holds a contiguous range of ids) or 'mod' (id v is in shard v mod n). "
    "A 'mod' checkpoint holds the shards in shard order, so it restores "
    'only into the same number of shards.')


def _PartitionMeta(p, specs):
  """FPropMeta's param_shards: shape, bytes and device of each shard."""
  out = []
  for var_name, shape, axis in specs:
    out += sharding.ShardInfo(p, var_name, shape, p.dtype, axis)
  return out


class EmbeddingLayer(base_layer.BaseLayer):
  """Token plus position embedding: ids [B, T] -> [B, T, embedding_dim].

  Ids may come as floats (a GPipe pipeline carries one dtype for all its
  states); they are cast to int32. The lookup is a gather (0 FLOPs); the
  FLOPs are the optional sqrt(D) scaling and the position add.

  With `partitioner`, the token table `emb` [vocab_size, D] is cut along the
  vocabulary into shards (theta.emb is their list) and looked up with
  tf.compat.v1.nn.embedding_lookup(partition_strategy=...): each shard's
  gradient is a tf.IndexedSlices.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Number of tokens.')
    p.Define('embedding_dim', 0, 'Depth D of the embeddings.')
    p.Define('max_seq_len', 0, 'Longest sequence T the layer accepts.')
    p.Define('position_embedding', 'LEARNED',
             'LEARNED (a variable), SINUSOIDAL (a constant) or NONE.')
    p.Define('scale_sqrt_depth', False,
             'Whether to multiply token embeddings by sqrt(embedding_dim).')
    p.Define('partitioner', None,
             'Partitioning of the token table along the vocabulary. ' +
             _PARTITIONER_DOC)
    p.Define('partition_strategy', 'div', _PARTITION_STRATEGY_DOC)
    return p

  @classmethod
  def _CheckParams(cls, p):
    layer_util.CheckPositive(p, 'vocab_size', 'embedding_dim', 'max_seq_len')
    layer_util.CheckChoice(p, 'position_embedding', POSITION_EMBEDDINGS)
    sharding.CheckPartitionStrategy(p)
    sharding.NumShards(p, [p.vocab_size, p.embedding_dim], p.dtype)

  def __init__(self, params):
    super().__init__(params)
    self._CheckParams(self.params)

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    sharding.CreatePartitionedVariable(
        self, 'emb',
        py_utils.WeightParams(
            shape=[p.vocab_size, p.embedding_dim],
            init=p.params_init,
            dtype=p.dtype))
    if p.position_embedding == 'LEARNED':
      layer_util.CreateWeight(self, 'pos_emb', [p.max_seq_len, p.embedding_dim])

  def FProp(self, theta, ids):
    """Embeds ids [B, T] into [B, T, embedding_dim]."""
    p = self.params
    x = self._Tokens(theta, ids)
    if p.position_embedding == 'NONE':
      return x
    seq_len = layer_util.Shape(ids)[1]
    if isinstance(seq_len, int) and seq_len > p.max_seq_len:
      raise ValueError('%s: sequence length %d > max_seq_len=%d; raise '
                       'max_seq_len.' % (p.name, seq_len, p.max_seq_len))
    return x + self._PositionTable(theta, x.dtype)[tf.newaxis, :seq_len, :]

  def ExtendStep(self, theta, ids, time_step):
    """Embeds ids [B] at position `time_step` (int32 scalar) into [B, D]."""
    p = self.params
    x = self._Tokens(theta, ids)
    if p.position_embedding == 'NONE':
      return x
    return x + self._PositionTable(theta, x.dtype)[time_step][tf.newaxis, :]

  def _Tokens(self, theta, ids):
    """The token embeddings of ids (any shape; floats are cast to int32)."""
    p = self.params
    if not ids.dtype.is_integer:
      ids = tf.cast(ids, tf.int32)
    if p.partitioner is None:
      x = tf.gather(theta.emb, ids)
    else:
      x = tf.compat.v1.nn.embedding_lookup(
          list(theta.emb), ids, partition_strategy=p.partition_strategy)
    if p.scale_sqrt_depth:
      x *= p.embedding_dim**0.5
    return x

  def _PositionTable(self, theta, dtype):
    """[max_seq_len, D]: the learned table, or the sinusoids as a constant."""
    p = self.params
    if p.position_embedding == 'LEARNED':
      return theta.pos_emb
    return tf.constant(
        SinusoidalPositionTable(p.max_seq_len, p.embedding_dim), dtype=dtype)

  @classmethod
  def FPropMeta(cls, p, ids):
    """FLOPs, out_shapes and param_shards (the token table's shards)."""
    py_utils.CheckShapes((ids,))
    cls._CheckParams(p)
    layer_util.CheckRank(p, ids, 2, 'ids')
    seq_len = flops.ToInt(ids[1])
    if isinstance(seq_len, int) and seq_len > p.max_seq_len:
      raise ValueError('%s: sequence length %d > max_seq_len=%d; raise '
                       'max_seq_len.' % (p.name, seq_len, p.max_seq_len))
    out = tshape.Shape(ids[:] + [p.embedding_dim])
    n = out.num_elements()
    num_flops = 0
    if p.scale_sqrt_depth:
      num_flops += n
    if p.position_embedding != 'NONE':
      num_flops += n
    return layer_util.Meta(num_flops, out, param_shards=_PartitionMeta(
        p, [('emb', [p.vocab_size, p.embedding_dim], 0)]))

  @classmethod
  def FakeInputs(cls, p, ids):
    """Random in-range ids of shape ids, for timing the layer."""
    return tf.random.stateless_uniform(
        ids.ToTensorShape().as_list(),
        seed=[1, 2],
        minval=0,
        maxval=p.vocab_size,
        dtype=tf.int32)


class SoftmaxLayer(base_layer.BaseLayer):
  """Output projection to logits: [..., input_dim] -> [..., num_classes].

  Returns logits; the loss (softmax cross-entropy) is the task's. With
  apply_layer_norm, a final layer norm comes first, as a pre-LN Transformer
  stack needs.

  With `partitioner`, the projection logits.w [input_dim, num_classes] is cut
  along the classes (and logits.b into as many shards, by
  tf.compat.v1.fixed_size_partitioner); each shard's logits are computed on
  the shard's device and concatenated ('mod' puts them back in class order
  with one gather). Variable names are those of the unpartitioned layer.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input (its last dim).')
    p.Define('num_classes', 0, 'Number of classes (vocab size for an LM).')
    p.Define('apply_layer_norm', False,
             'Whether to layer-normalize the input first.')
    p.Define('has_bias', True, 'Whether the projection has a bias.')
    p.Define('partitioner', None,
             'Partitioning of the projection along the classes. ' +
             _PARTITIONER_DOC)
    p.Define('partition_strategy', 'div', _PARTITION_STRATEGY_DOC)
    return p

  @classmethod
  def _ChildParams(cls, p):
    children = []
    if p.apply_layer_norm:
      ln = dense_layers.LayerNormLayer.Params().Set(input_dim=p.input_dim)
      children.append(('ln', ln))
    children.append(('logits',
                     dense_layers.FCLayer.Params().Set(
                         input_dim=p.input_dim,
                         output_dim=p.num_classes,
                         has_bias=p.has_bias)))
    return children

  @classmethod
  def _CheckParams(cls, p):
    layer_util.CheckPositive(p, 'input_dim', 'num_classes')
    sharding.CheckPartitionStrategy(p)
    return sharding.NumShards(p, [p.input_dim, p.num_classes], p.dtype, 1)

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._num_shards = self._CheckParams(p)
    for name, child in self._ChildParams(p):
      if name == 'logits' and p.partitioner is not None:
        continue  # Made in _CreateLayerVariables, partitioned.
      self.CreateChild(name, child)

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    if p.partitioner is None:
      return
    # The unpartitioned layer's names: <layer>/logits/{w,b}/var.
    with tf.variable_scope('logits'):
      w = sharding.CreatePartitionedVariable(
          self, 'w',
          py_utils.WeightParams(
              shape=[p.input_dim, p.num_classes],
              init=p.params_init,
              dtype=p.dtype),
          axis=1)
      b = []
      if p.has_bias:
        # As many shards as w, whatever p.partitioner would give a vector.
        b = sharding.CreatePartitionedVariable(
            self, 'b',
            py_utils.WeightParams(
                shape=[p.num_classes],
                init=py_utils.WeightInit.Constant(0.0),
                dtype=p.dtype),
            spec=p.Copy().Set(
                partitioner=('fixed_size', dict(num_shards=len(w)))))
    for store in (self._private_vars, self._private_theta):
      store.pop('w')
      store.pop('b', None)
      store['logits'] = py_utils.NestedMap(w=list(w))
      if p.has_bias:
        store['logits'].b = list(b)

  def _ModOrder(self, sizes):
    """Positions in the concatenated shard logits of classes 0, 1, ..."""
    n = len(sizes)
    offsets = np.cumsum([0] + sizes[:-1])
    c = np.arange(self.params.num_classes)
    return (offsets[c % n] + c // n).astype(np.int32)

  def _ShardedLogits(self, theta, x):
    p = self.params
    shape = layer_util.Shape(x)
    x = tf.reshape(x, [-1, p.input_dim])
    ws = list(theta.logits.w)
    bs = list(theta.logits.b) if p.has_bias else [None] * len(ws)
    parts = []
    for w, b in zip(ws, bs):
      # Each shard's logits where the shard lives (a sharded matmul).
      with tf.device(w.device):
        y = tf.matmul(x, w)
        if b is not None:
          y = tf.nn.bias_add(y, b)
      parts.append(y)
    logits = tf.concat(parts, axis=-1)
    if p.partition_strategy == 'mod' and len(parts) > 1:
      sizes = [int(w.shape[1]) for w in ws]
      logits = tf.gather(logits, self._ModOrder(sizes), axis=-1)
    return tf.reshape(logits, shape[:-1] + [p.num_classes])

  def FProp(self, theta, inputs):
    """Returns logits [..., num_classes] of inputs [..., input_dim]."""
    p = self.params
    x = inputs
    if p.apply_layer_norm:
      x = self.ln.FProp(theta.ln, x)
    if p.partitioner is not None:
      return self._ShardedLogits(theta, x)
    return self.logits.FProp(theta.logits, x)

  @classmethod
  def FPropMeta(cls, p, inputs):
    """FLOPs, out_shapes and param_shards (the projection's shards)."""
    py_utils.CheckShapes((inputs,))
    n = cls._CheckParams(p)
    layer_util.CheckLastDim(p, inputs, p.input_dim, 'input_dim')
    num_flops = 0
    shape = inputs
    for _, child in cls._ChildParams(p):
      meta = child.cls.FPropMeta(child, shape)
      num_flops += meta.flops
      shape = meta.out_shapes[0]
    shards = _PartitionMeta(p, [('logits.w', [p.input_dim, p.num_classes], 1)])
    if p.has_bias:
      shards += _PartitionMeta(
          p.Copy().Set(partitioner=None if p.partitioner is None else
                       ('fixed_size', dict(num_shards=n))),
          [('logits.b', [p.num_classes], 0)])
    return layer_util.Meta(num_flops, shape, param_shards=shards)
