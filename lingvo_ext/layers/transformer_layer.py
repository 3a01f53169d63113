"""TransformerLayer: a pre-LayerNorm Transformer layer, with accurate FPropMeta.

The conventions of every layer here are in `lingvo_ext.layers`.
"""

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np

from lingvo_ext.layers import dense_layers
from lingvo_ext.layers import flops
from lingvo_ext.layers import layer_util


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
    ln = dense_layers.LayerNormLayer.Params().Set(input_dim=d,
                                                  epsilon=p.ln_epsilon)
    fc = dense_layers.FCLayer.Params()
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
    layer_util.CheckPositive(p, 'model_dim', 'num_heads', 'hidden_dim')
    layer_util.CheckChoice(p, 'activation', layer_util.ACTIVATIONS)
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
    return self._FPropAndKeys(theta, inputs)[0]

  def _FPropAndKeys(self, theta, inputs):
    """(outputs [B, T, D], keys [B, N, T, H], values [B, N, T, H])."""
    p = self.params
    batch, seq_len, _ = layer_util.Shape(inputs)
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
    return self._Feedforward(theta, inputs, ctx), k, v

  def _Feedforward(self, theta, inputs, ctx):
    """The attention's projection and residual, then the feed-forward net."""
    h = inputs + self.atten_out.FProp(theta.atten_out, ctx)
    y = self.ln_ffn.FProp(theta.ln_ffn, h)
    y = self.ffn_in.FProp(theta.ffn_in, y)
    y = self.ffn_out.FProp(theta.ffn_out, y)
    return h + y

  # --- Incremental decoding, as Lingvo's layers' ExtendStep: a cache of the
  # keys and values of every position so far, time-major [S, B, N, H].

  def _CheckCausal(self):
    if not self.params.mask_self_atten:
      raise ValueError(
          f'{self.params.name}: decoding one position at a time needs '
          'causal self-attention; set mask_self_atten=True.')

  def Prefill(self, theta, inputs, max_len):
    """FProp of inputs [B, T, D], with the cache of their keys and values.

    Args:
      theta: The layer's weights.
      inputs: [B, T, model_dim], positions 0..T-1.
      max_len: The cache's length S >= T (an int or int32 scalar).

    Returns:
      (outputs [B, T, model_dim], NestedMap(key, value) of [S, B, N, H]:
      positions 0..T-1 filled, the others 0).
    """
    self._CheckCausal()
    out, k, v = self._FPropAndKeys(theta, inputs)
    pad = max_len - layer_util.Shape(inputs)[1]

    def Cache(x):  # [B, N, T, H] -> [S, B, N, H]
      return tf.pad(tf.transpose(x, [2, 0, 1, 3]), [[0, pad], [0, 0], [0, 0],
                                                     [0, 0]])

    return out, py_utils.NestedMap(key=Cache(k), value=Cache(v))

  def ExtendStep(self, theta, inputs, cached_states, time_step):
    """The layer at one position, attending to the cached earlier ones.

    Args:
      theta: The layer's weights.
      inputs: [B, model_dim], position `time_step`.
      cached_states: NestedMap(key, value) of [S, B, N, H], filled before
        `time_step` (as Prefill or earlier steps left it).
      time_step: int32 scalar, the position (< S).

    Returns:
      (outputs [B, model_dim], cached_states with `time_step`'s key and value).
    """
    self._CheckCausal()
    p = self.params
    batch = layer_util.Shape(inputs)[0]
    head_dim = p.model_dim // p.num_heads
    x = self.ln_atten.FProp(theta.ln_atten, inputs)
    qkv = self.qkv.FProp(theta.qkv, x)
    q, k, v = [
        tf.reshape(t, [batch, p.num_heads, head_dim])
        for t in tf.split(qkv, 3, axis=-1)
    ]
    q *= head_dim**-0.5
    at = [[time_step]]
    key = tf.tensor_scatter_nd_update(cached_states.key, at, k[tf.newaxis])
    value = tf.tensor_scatter_nd_update(cached_states.value, at,
                                        v[tf.newaxis])
    logits = tf.einsum('BNH,SBNH->BNS', q, key)
    # FProp's causal bias: the positions after time_step do not count.
    later = tf.range(tf.shape(key)[0]) > time_step
    logits += tf.cast(
        tf.compat.v2.where(later, -0.7 * logits.dtype.max, 0.0), logits.dtype)
    ctx = tf.einsum('BNS,SBNH->BNH', tf.nn.softmax(logits), value)
    out = self._Feedforward(theta, inputs,
                            tf.reshape(ctx, [batch, p.model_dim]))
    return out, py_utils.NestedMap(key=key, value=value)

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    cls._CheckParams(p)
    layer_util.CheckRank(p, inputs, 3, 'inputs')
    layer_util.CheckLastDim(p, inputs, p.model_dim, 'model_dim')
    batch, seq_len, _ = inputs
    num_flops = 0
    for _, child in cls._ChildParams(p):
      child_in = inputs
      if child.cls is dense_layers.FCLayer:
        child_in = tshape.Shape(inputs[:-1] + [child.input_dim])
      num_flops += child.cls.FPropMeta(child, child_in).flops
    num_flops += flops.AttentionFlops(batch, seq_len, seq_len, p.model_dim,
                                      p.num_heads, p.mask_self_atten)
    num_flops += 2 * inputs.num_elements()  # The two residual adds.
    return layer_util.Meta(num_flops, inputs)

  # FLOPs FPropMeta counts that TF's profiler does not: the FFN activation's.
  UnprofiledFlops = layer_util.UnprofiledActivation(
      lambda cls, p, x: x.num_elements() // p.model_dim * p.hidden_dim)
