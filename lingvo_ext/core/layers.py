"""The layers lingvo_ext's tasks are built from, with accurate FPropMeta.

Every layer here can be a sub-layer of a GPipe `FeatureExtractionLayer`:
`FProp(theta, x)` returns one tensor, and the classmethod
`FPropMeta(p, *shapes)` takes `tshape.Shape`s and returns
`NestedMap(flops=..., out_shapes=(tshape.Shape,))`.

FLOPs are forward FLOPs with a multiply-add counted as 2, the same count
TensorFlow's profiler gives for the layer's FProp graph. The layers are
written with ops the profiler has FLOP statistics for where there is a
choice (e.g. a causal mask is an Add of a bias, not a Select); the few ops it
has none for (Relu, Tanh, Max) are named in flops.py and in the FPropMeta
that counts them. Gathers, reshapes, transposes, slices and casts cost 0.

No layer keeps batch statistics: a micro-batched pipeline run must equal the
sequential run exactly.
"""

import math

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np

from lingvo_ext.core import flops
from lingvo_ext.core import sharding

ACTIVATIONS = ('NONE', 'RELU', 'TANH', 'GELU')
POOLING_TYPES = ('MAX', 'AVG')
PADDINGS = ('SAME', 'VALID')
POSITION_EMBEDDINGS = ('LEARNED', 'SINUSOIDAL', 'NONE')


def _CheckChoice(p, name, choices):
  value = p.Get(name)
  if value not in choices:
    raise ValueError('%s.%s=%r is not supported; set it to one of %s.' %
                     (p.cls.__name__, name, value, ', '.join(choices)))


def _CheckPositive(p, *names):
  for name in names:
    value = p.Get(name)
    if not isinstance(value, (int, np.integer)) or value <= 0:
      raise ValueError('%s.%s=%r must be a positive int; set it.' %
                       (p.cls.__name__, name, value))


def _CheckPositiveInts(p, name, count, what=''):
  """Param `name` must be `count` positive ints (what: e.g. ' [h, w]')."""
  value = p.Get(name)
  if (len(value) != count or
      not all(isinstance(d, (int, np.integer)) and d > 0 for d in value)):
    raise ValueError('%s.%s=%r must be %d positive ints%s.' %
                     (p.cls.__name__, name, value, count, what))


def _CheckRank(p, shape, rank, what):
  if shape.rank != rank:
    raise ValueError('%s (%s) expects %s of rank %d, got shape %s.' %
                     (p.cls.__name__, p.name, what, rank, shape))


def _CheckLastDim(p, shape, dim, param_name):
  if shape.rank < 1 or shape[-1] != dim:
    raise ValueError(
        '%s (%s): input shape %s does not end in %s=%s; set %s to the '
        'input depth.' % (p.cls.__name__, p.name, shape, param_name, dim,
                          param_name))


def _Meta(num_flops, out, **extra) -> py_utils.NestedMap:
  """FPropMeta's result: FLOPs (an int where known), out_shapes=(out,)."""
  return py_utils.NestedMap(flops=flops.ToInt(num_flops), out_shapes=(out,),
                            **extra)


def _UnprofiledActivation(activated):
  """An UnprofiledFlops(p, inputs) classmethod: p.activation's FLOPs that TF's
  profiler does not count, over activated(cls, p, inputs) elements."""
  return classmethod(lambda cls, p, inputs: flops.ToInt(
      flops.ActivationUnprofiledFlops(p.activation, activated(cls, p, inputs))))


def Activate(x, activation):
  """Applies activation ('NONE', 'RELU', 'TANH', 'GELU') to x."""
  if activation == 'NONE':
    return x
  if activation == 'RELU':
    return tf.nn.relu(x)
  if activation == 'TANH':
    return tf.tanh(x)
  if activation == 'GELU':
    # The tanh form: 7 profiled ops and a Tanh (see flops.ACTIVATION_FLOPS).
    return tf.nn.gelu(x, approximate=True)
  raise ValueError('activation=%r is not supported; choose one of %s.' %
                   (activation, ', '.join(ACTIVATIONS)))


def _CreateWeight(layer, name, shape, init=None):
  """layer's variable `name` of `shape`, in its dtype; init: params_init."""
  p = layer.params
  layer.CreateVariable(name, py_utils.WeightParams(
      shape=shape, init=init or p.params_init, dtype=p.dtype))


def _Shape(x):
  """Static dims where known, else dynamic ones."""
  return py_utils.GetShape(x)


class FCLayer(base_layer.BaseLayer):
  """Fully connected layer: activation(x * w + b) on [..., input_dim]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input (its last dim).')
    p.Define('output_dim', 0, 'Depth of the output.')
    p.Define('activation', 'NONE',
             'Activation after the projection: NONE, RELU, TANH or GELU.')
    p.Define('has_bias', True, 'Whether to add a learned bias.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckPositive(p, 'input_dim', 'output_dim')
    _CheckChoice(p, 'activation', ACTIVATIONS)

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    _CreateWeight(self, 'w', [p.input_dim, p.output_dim])
    if p.has_bias:
      _CreateWeight(self, 'b', [p.output_dim],
                    py_utils.WeightInit.Constant(0.0))

  def FProp(self, theta, inputs):
    """Projects inputs [..., input_dim] to [..., output_dim]."""
    p = self.params
    shape = _Shape(inputs)
    x = inputs if len(shape) == 2 else tf.reshape(inputs, [-1, p.input_dim])
    x = tf.matmul(x, theta.w)
    if p.has_bias:
      x = tf.nn.bias_add(x, theta.b)
    x = Activate(x, p.activation)
    if len(shape) != 2:
      x = tf.reshape(x, shape[:-1] + [p.output_dim])
    return x

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    _CheckLastDim(p, inputs, p.input_dim, 'input_dim')
    rows = inputs.num_elements() // p.input_dim
    num_flops = flops.FCFlops(rows, p.input_dim, p.output_dim, p.activation,
                              p.has_bias)
    out = tshape.Shape(inputs[:-1] + [p.output_dim])
    return _Meta(num_flops, out)

  # FLOPs FPropMeta counts that TF's profiler does not: the activation's.
  UnprofiledFlops = _UnprofiledActivation(
      lambda cls, p, x: x.num_elements() // p.input_dim * p.output_dim)


class LayerNormLayer(base_layer.BaseLayer):
  """Layer normalization over the last dim, with scale and bias.

  Written out in profiled ops (Mean, SquaredDifference, Rsqrt...) rather than
  a fused kernel, so that its FLOPs are visible to TF's profiler.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input (its last dim).')
    p.Define('epsilon', 1e-6, 'Added to the variance before rsqrt.')
    return p

  def __init__(self, params):
    super().__init__(params)
    _CheckPositive(self.params, 'input_dim')

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    _CreateWeight(self, 'scale', [p.input_dim],
                  py_utils.WeightInit.Constant(1.0))
    _CreateWeight(self, 'bias', [p.input_dim],
                  py_utils.WeightInit.Constant(0.0))

  def FProp(self, theta, inputs):
    """Normalizes inputs [..., input_dim]."""
    p = self.params
    mean = tf.reduce_mean(inputs, axis=-1, keepdims=True)
    variance = tf.reduce_mean(
        tf.math.squared_difference(inputs, mean), axis=-1, keepdims=True)
    x = (inputs - mean) * tf.math.rsqrt(variance + p.epsilon)
    return x * theta.scale + theta.bias

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    _CheckLastDim(p, inputs, p.input_dim, 'input_dim')
    num_flops = flops.LayerNormFlops(inputs.num_elements(), p.input_dim)
    return _Meta(num_flops, inputs)


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
    'lingvo_ext/core/sharding.py). Checkpoints restore into any other '
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
    _CheckPositive(p, 'vocab_size', 'embedding_dim', 'max_seq_len')
    _CheckChoice(p, 'position_embedding', POSITION_EMBEDDINGS)
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
      _CreateWeight(self, 'pos_emb', [p.max_seq_len, p.embedding_dim])

  def FProp(self, theta, ids):
    """Embeds ids [B, T] into [B, T, embedding_dim]."""
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
    if p.position_embedding == 'NONE':
      return x
    seq_len = _Shape(ids)[1]
    if isinstance(seq_len, int) and seq_len > p.max_seq_len:
      raise ValueError('%s: sequence length %d > max_seq_len=%d; raise '
                       'max_seq_len.' % (p.name, seq_len, p.max_seq_len))
    if p.position_embedding == 'LEARNED':
      table = theta.pos_emb
    else:
      table = tf.constant(
          SinusoidalPositionTable(p.max_seq_len, p.embedding_dim),
          dtype=x.dtype)
    return x + table[tf.newaxis, :seq_len, :]

  @classmethod
  def FPropMeta(cls, p, ids):
    """FLOPs, out_shapes and param_shards (the token table's shards)."""
    py_utils.CheckShapes((ids,))
    cls._CheckParams(p)
    _CheckRank(p, ids, 2, 'ids')
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
    return _Meta(num_flops, out, param_shards=_PartitionMeta(
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


class TransformerLayer(base_layer.BaseLayer):
  """Pre-LayerNorm Transformer layer on [B, T, model_dim].

    h = x + Proj(SelfAttention(LN(x)))
    y = h + FFN(LN(h))

  The self-attention uses a fused QKV projection; no dropout.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('model_dim', 0, 'Model depth D.')
    p.Define('num_heads', 0, 'Number of attention heads; must divide D.')
    p.Define('hidden_dim', 0, 'Hidden depth F of the feed-forward net.')
    p.Define('mask_self_atten', False,
             'Whether self-attention is causal (each position sees itself '
             'and earlier ones only).')
    p.Define('activation', 'RELU',
             'Feed-forward activation: NONE, RELU, TANH or GELU.')
    p.Define('ln_epsilon', 1e-6, 'Epsilon of the layer norms.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    """The sub-layers' params, used by __init__ and FPropMeta alike."""
    d, f = p.model_dim, p.hidden_dim
    ln = LayerNormLayer.Params().Set(input_dim=d, epsilon=p.ln_epsilon)
    fc = FCLayer.Params()
    return [
        ('ln_atten', ln.Copy()),
        ('qkv', fc.Copy().Set(input_dim=d, output_dim=3 * d)),
        ('atten_out', fc.Copy().Set(input_dim=d, output_dim=d)),
        ('ln_ffn', ln.Copy()),
        ('ffn_in',
         fc.Copy().Set(input_dim=d, output_dim=f, activation=p.activation)),
        ('ffn_out', fc.Copy().Set(input_dim=f, output_dim=d)),
    ]

  @classmethod
  def _CheckParams(cls, p):
    _CheckPositive(p, 'model_dim', 'num_heads', 'hidden_dim')
    _CheckChoice(p, 'activation', ACTIVATIONS)
    if p.model_dim % p.num_heads:
      raise ValueError(
          'TransformerLayer: num_heads=%d does not divide model_dim=%d; pick '
          'num_heads that divides model_dim.' % (p.num_heads, p.model_dim))

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._CheckParams(p)
    for name, child in self._ChildParams(p):
      self.CreateChild(name, child)

  def _SplitHeads(self, x, batch, seq_len):
    p = self.params
    x = tf.reshape(
        x, [batch, seq_len, p.num_heads, p.model_dim // p.num_heads])
    return tf.transpose(x, [0, 2, 1, 3])

  def _CausalBias(self, seq_len, dtype):
    """[T, T] bias: 0 where a query may attend, a large negative elsewhere."""
    if isinstance(seq_len, int):
      # A constant, so that building the mask costs no FLOPs.
      allowed = np.tril(np.ones([seq_len, seq_len], dtype=np.bool_))
      bias = np.where(allowed, 0.0, -0.7 * dtype.max).astype(
          dtype.as_numpy_dtype)
      return tf.constant(bias, dtype=dtype)
    allowed = tf.linalg.band_part(tf.ones([seq_len, seq_len], dtype), -1, 0)
    return (1.0 - allowed) * (-0.7 * dtype.max)

  def FProp(self, theta, inputs):
    """Applies the layer to inputs [B, T, model_dim]."""
    p = self.params
    batch, seq_len, _ = _Shape(inputs)
    head_dim = p.model_dim // p.num_heads

    x = self.ln_atten.FProp(theta.ln_atten, inputs)
    qkv = self.qkv.FProp(theta.qkv, x)
    q, k, v = tf.split(qkv, 3, axis=-1)
    q = self._SplitHeads(q, batch, seq_len) * head_dim**-0.5
    k = self._SplitHeads(k, batch, seq_len)
    v = self._SplitHeads(v, batch, seq_len)
    logits = tf.matmul(q, k, transpose_b=True)  # [B, N, T, T]
    if p.mask_self_atten:
      logits += self._CausalBias(seq_len, logits.dtype)
    probs = tf.nn.softmax(logits)
    ctx = tf.matmul(probs, v)  # [B, N, T, H]
    ctx = tf.reshape(
        tf.transpose(ctx, [0, 2, 1, 3]), [batch, seq_len, p.model_dim])
    h = inputs + self.atten_out.FProp(theta.atten_out, ctx)

    y = self.ln_ffn.FProp(theta.ln_ffn, h)
    y = self.ffn_in.FProp(theta.ffn_in, y)
    y = self.ffn_out.FProp(theta.ffn_out, y)
    return h + y

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    cls._CheckParams(p)
    _CheckRank(p, inputs, 3, 'inputs')
    _CheckLastDim(p, inputs, p.model_dim, 'model_dim')
    batch, seq_len, _ = inputs
    num_flops = 0
    for _, child in cls._ChildParams(p):
      child_in = inputs
      if child.cls is FCLayer:
        child_in = tshape.Shape(inputs[:-1] + [child.input_dim])
      num_flops += child.cls.FPropMeta(child, child_in).flops
    num_flops += flops.AttentionFlops(batch, seq_len, seq_len, p.model_dim,
                                      p.num_heads, p.mask_self_atten)
    num_flops += 2 * inputs.num_elements()  # The two residual adds.
    return _Meta(num_flops, inputs)

  # FLOPs FPropMeta counts that TF's profiler does not: the FFN activation's.
  UnprofiledFlops = _UnprofiledActivation(
      lambda cls, p, x: x.num_elements() // p.model_dim * p.hidden_dim)


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
      children.append(
          ('ln', LayerNormLayer.Params().Set(input_dim=p.input_dim)))
    children.append(('logits',
                     FCLayer.Params().Set(
                         input_dim=p.input_dim,
                         output_dim=p.num_classes,
                         has_bias=p.has_bias)))
    return children

  @classmethod
  def _CheckParams(cls, p):
    _CheckPositive(p, 'input_dim', 'num_classes')
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
    shape = _Shape(x)
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
    _CheckLastDim(p, inputs, p.input_dim, 'input_dim')
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
    return _Meta(num_flops, shape, param_shards=shards)


class Conv2DLayer(base_layer.BaseLayer):
  """2D convolution on NHWC inputs, with bias and activation."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('filter_shape', (0, 0, 0, 0),
             'Filter shape [height, width, in_channels, out_channels].')
    p.Define('filter_stride', (1, 1), 'Strides [height, width].')
    p.Define('padding', 'SAME', 'SAME or VALID.')
    p.Define('activation', 'NONE',
             'Activation after the conv: NONE, RELU, TANH or GELU.')
    p.Define('has_bias', True, 'Whether to add a learned bias.')
    return p

  @classmethod
  def _CheckParams(cls, p):
    _CheckPositiveInts(p, 'filter_shape', 4, ' [h, w, in, out]')
    _CheckPositiveInts(p, 'filter_stride', 2)
    _CheckChoice(p, 'padding', PADDINGS)
    _CheckChoice(p, 'activation', ACTIVATIONS)

  def __init__(self, params):
    super().__init__(params)
    self._CheckParams(self.params)

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    _CreateWeight(self, 'w', list(p.filter_shape))
    if p.has_bias:
      _CreateWeight(self, 'b', [p.filter_shape[-1]],
                    py_utils.WeightInit.Constant(0.0))

  def FProp(self, theta, inputs):
    """Convolves inputs [B, H, W, in] into [B, H', W', out]."""
    p = self.params
    sh, sw = p.filter_stride
    x = tf.nn.conv2d(inputs, theta.w, strides=[1, sh, sw, 1], padding=p.padding)
    if p.has_bias:
      x = tf.nn.bias_add(x, theta.b)
    return Activate(x, p.activation)

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    cls._CheckParams(p)
    _CheckRank(p, inputs, 4, 'NHWC inputs')
    fh, fw, ic, oc = p.filter_shape
    _CheckLastDim(p, inputs, ic, 'filter_shape[2]')
    b, h, w, _ = inputs
    sh, sw = p.filter_stride
    oh = flops.Conv2DOutputSize(h, fh, sh, p.padding)
    ow = flops.Conv2DOutputSize(w, fw, sw, p.padding)
    out = tshape.Shape([b, oh, ow, oc])
    n = out.num_elements()
    num_flops = flops.Conv2DFlops(b, oh, ow, fh, fw, ic, oc)
    if p.has_bias:
      num_flops += n
    num_flops += flops.ActivationFlops(p.activation, n)
    return _Meta(num_flops, out)

  # FLOPs FPropMeta counts that TF's profiler does not: the activation's.
  UnprofiledFlops = _UnprofiledActivation(
      lambda cls, p, x: cls.FPropMeta(p, x).out_shapes[0].num_elements())


class PoolingLayer(base_layer.BaseLayer):
  """Max or average pooling on NHWC inputs."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('window', (2, 2), 'Pooling window [height, width].')
    p.Define('stride', (2, 2), 'Strides [height, width].')
    p.Define('pooling_type', 'MAX', 'MAX or AVG.')
    p.Define('padding', 'SAME', 'SAME or VALID.')
    return p

  @classmethod
  def _CheckParams(cls, p):
    for name in ('window', 'stride'):
      _CheckPositiveInts(p, name, 2)
    _CheckChoice(p, 'pooling_type', POOLING_TYPES)
    _CheckChoice(p, 'padding', PADDINGS)

  def __init__(self, params):
    super().__init__(params)
    self._CheckParams(self.params)

  def FProp(self, theta, inputs):
    """Pools inputs [B, H, W, C] into [B, H', W', C]."""
    del theta
    p = self.params
    pool = tf.nn.max_pool2d if p.pooling_type == 'MAX' else tf.nn.avg_pool2d
    return pool(
        inputs,
        ksize=[1] + list(p.window) + [1],
        strides=[1] + list(p.stride) + [1],
        padding=p.padding)

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    cls._CheckParams(p)
    _CheckRank(p, inputs, 4, 'NHWC inputs')
    b, h, w, c = inputs
    oh = flops.Conv2DOutputSize(h, p.window[0], p.stride[0], p.padding)
    ow = flops.Conv2DOutputSize(w, p.window[1], p.stride[1], p.padding)
    out = tshape.Shape([b, oh, ow, c])
    num_flops = flops.PoolFlops(out.num_elements(), *p.window)
    return _Meta(num_flops, out)


class GlobalPoolingLayer(base_layer.BaseLayer):
  """Pools [B, H, W, C] over H and W into [B, C]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('pooling_type', 'AVG', 'AVG or MAX.')
    return p

  def __init__(self, params):
    super().__init__(params)
    _CheckChoice(self.params, 'pooling_type', POOLING_TYPES)

  def FProp(self, theta, inputs):
    """Pools inputs [B, H, W, C] into [B, C]."""
    del theta
    if self.params.pooling_type == 'AVG':
      return tf.reduce_mean(inputs, axis=[1, 2])
    return tf.reduce_max(inputs, axis=[1, 2])

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    _CheckRank(p, inputs, 4, 'NHWC inputs')
    # One add (AVG; the divide per output is folded into Mean's count) or one
    # compare (MAX) per input element.
    num_flops = inputs.num_elements()
    out = tshape.Shape([inputs[0], inputs[3]])
    return _Meta(num_flops, out)

  @classmethod
  def UnprofiledFlops(cls, p, inputs):
    """TF's profiler has no FLOP statistics for Max (the MAX reduction)."""
    if p.pooling_type == 'MAX':
      return flops.ToInt(inputs.num_elements())
    return 0


class FlattenLayer(base_layer.BaseLayer):
  """Reshapes [B, d1, d2, ...] into [B, d1*d2*...]; 0 FLOPs."""

  def FProp(self, theta, inputs):
    """Flattens all but the first dim of inputs."""
    del theta
    shape = _Shape(inputs)
    return tf.reshape(inputs, [shape[0], -1])

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    rest = 1
    for d in inputs[1:]:
      rest *= d
    out = tshape.Shape([inputs[0], rest])
    return _Meta(0, out)
