"""FLOP formulas: pure arithmetic on ints and sympy expressions.

FLOPs count a multiply-add as 2, the convention of TensorFlow's profiler
(`tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()`). Each formula
names the TensorFlow ops it stands for and says which of them the profiler
leaves out (it registers FLOPs for only some ops: Relu, Tanh, Exp, Erf, Max,
GatherV2 and Einsum, among others, count 0 there).

The formulas work on ints and on sympy expressions alike, so that
`FPropMeta` can be called on symbolic `tshape.Shape`s. Nothing here builds a
graph; measuring in TensorFlow is cost.py's.
"""

from typing import Any

import lingvo.compat as tf
from lingvo.core import tshape
import sympy

# Per-element FLOPs of the activations FCLayer and Conv2DLayer support.
# GELU is tf.nn.gelu(approximate=True):
#   0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3)))
# = Pow, Mul, AddV2, Mul, Tanh, AddV2, Mul, Mul: 8 ops, 7 of them profiled.
ACTIVATION_FLOPS = {'NONE': 0, 'RELU': 1, 'TANH': 1, 'GELU': 8}
# The part of ACTIVATION_FLOPS that TensorFlow's profiler leaves out: it has
# no FLOP statistics for Relu and Tanh.
ACTIVATION_UNPROFILED_FLOPS = {'NONE': 0, 'RELU': 1, 'TANH': 1, 'GELU': 1}

# The layer-norm arithmetic in `LayerNormFlops`, per element and per row.
_LAYER_NORM_FLOPS_PER_ELEMENT = 8
_LAYER_NORM_FLOPS_PER_ROW = 3

# Softmax: shift by max, exp, sum, divide; the profiler's Softmax statistic.
SOFTMAX_FLOPS_PER_ELEMENT = 5


def ToInt(x):
  """Returns x as a Python int when it is a number, else x unchanged."""
  x = sympy.sympify(x)
  if x.is_number:
    return int(x)
  return x


def CeilDiv(a, b):
  """ceil(a / b) for ints or sympy integers."""
  return -(-a // b)


def NumElements(shape) -> Any:
  """Number of elements of a tshape.Shape, list of dims or tf.TensorShape."""
  if isinstance(shape, tshape.Shape):
    return shape.num_elements()
  if isinstance(shape, tf.TensorShape):
    return shape.num_elements()
  n = 1
  for d in shape:
    n *= d
  return n


def MatMulFlops(m, k, n):
  """FLOPs of [m, k] x [k, n] (MatMul / BatchMatMul, profiled as 2mkn)."""
  return 2 * m * k * n


def ElementwiseFlops(num_elements, flops_per_element=1):
  """FLOPs of an elementwise op (Add, Mul, BiasAdd...) over num_elements."""
  return num_elements * flops_per_element


def ActivationFlops(activation: str, num_elements):
  """FLOPs of activation applied to num_elements values."""
  if activation not in ACTIVATION_FLOPS:
    raise ValueError('activation=%r is not supported; choose one of %s.' %
                     (activation, sorted(ACTIVATION_FLOPS)))
  return num_elements * ACTIVATION_FLOPS[activation]


def ActivationUnprofiledFlops(activation: str, num_elements):
  """The part of ActivationFlops that TensorFlow's profiler does not count."""
  if activation not in ACTIVATION_UNPROFILED_FLOPS:
    raise ValueError('activation=%r is not supported; choose one of %s.' %
                     (activation, sorted(ACTIVATION_UNPROFILED_FLOPS)))
  return num_elements * ACTIVATION_UNPROFILED_FLOPS[activation]


def LayerNormFlops(num_elements, dim):
  """FLOPs of layer norm over the last dim of a num_elements tensor.

  mean = Mean(x) (n); var = Mean(SquaredDifference(x, mean)) (2n + n);
  (x - mean) (n) * Rsqrt(var + eps) (2 rows + rows) (n); * scale (n) + bias (n):
  8 per element and 3 per row, all of them profiled.

  Args:
    num_elements: Number of elements of the input.
    dim: Size of the normalised (last) dimension.

  Returns:
    The FLOP count.
  """
  rows = num_elements // dim
  return (_LAYER_NORM_FLOPS_PER_ELEMENT * num_elements +
          _LAYER_NORM_FLOPS_PER_ROW * rows)


def SoftmaxFlops(num_elements):
  """FLOPs of a softmax over num_elements logits (profiled as 5n)."""
  return SOFTMAX_FLOPS_PER_ELEMENT * num_elements


def FCFlops(rows, input_dim, output_dim, activation='NONE', has_bias=True):
  """FLOPs of a fully connected layer applied to `rows` input vectors."""
  flops = MatMulFlops(rows, input_dim, output_dim)
  if has_bias:
    flops += ElementwiseFlops(rows * output_dim)
  flops += ActivationFlops(activation, rows * output_dim)
  return flops


def AttentionFlops(batch, query_len, key_len, model_dim, num_heads,
                   causal=False):
  """FLOPs of multi-head dot-product attention, projections excluded.

  q * 1/sqrt(head_dim) (B*Tq*D); QK^T (2*B*Tq*Tk*D); + causal mask bias
  (B*N*Tq*Tk); softmax (5*B*N*Tq*Tk); AV (2*B*Tq*Tk*D). All profiled.

  Args:
    batch: Batch size B.
    query_len: Query length Tq.
    key_len: Key length Tk.
    model_dim: Model dim D = num_heads * head_dim.
    num_heads: Number of heads N.
    causal: Whether a causal mask bias is added to the logits.

  Returns:
    The FLOP count.
  """
  logits = batch * num_heads * query_len * key_len
  flops = batch * query_len * model_dim  # Query scaling.
  flops += 2 * MatMulFlops(batch * query_len, model_dim, key_len)  # QK^T, AV.
  flops += SoftmaxFlops(logits)
  if causal:
    flops += ElementwiseFlops(logits)
  return flops


def Conv2DOutputSize(size, window, stride, padding):
  """Output size along one spatial dim of a conv or pool (SAME / VALID)."""
  if padding == 'SAME':
    return CeilDiv(size, stride)
  if padding == 'VALID':
    return CeilDiv(size - window + 1, stride)
  raise ValueError("padding=%r is not supported; use 'SAME' or 'VALID'." %
                   (padding,))


def Conv2DFlops(batch, out_h, out_w, filter_h, filter_w, in_c, out_c):
  """FLOPs of a Conv2D, profiled as 2 * outputs * filter_h*filter_w*in_c."""
  return 2 * batch * out_h * out_w * out_c * filter_h * filter_w * in_c


def PoolFlops(out_elements, window_h, window_w):
  """FLOPs of Max/AvgPool: one per window element per output (profiled)."""
  return out_elements * window_h * window_w


def TransformerFlops(batch, seq_len, model_dim, num_heads, hidden_dim,
                     causal=False, activation='RELU'):
  """FLOPs of one pre-LN Transformer layer (TransformerLayer) on [B, T, D].

  Closed form of what TransformerLayer.FPropMeta adds up, for hand checks:
  2 layer norms, fused QKV projection (2*BT*D*3D + BT*3D), attention core,
  output projection (2*BT*D^2 + BT*D), residual (BT*D), FFN in (2*BT*D*F +
  BT*F + activation), FFN out (2*BT*F*D + BT*D), residual (BT*D).

  Args:
    batch: B.
    seq_len: T.
    model_dim: D.
    num_heads: N.
    hidden_dim: F, the feed-forward hidden dim.
    causal: Whether self-attention is causally masked.
    activation: The feed-forward activation.

  Returns:
    The FLOP count.
  """
  rows = batch * seq_len
  n = rows * model_dim
  flops = 2 * LayerNormFlops(n, model_dim)
  flops += FCFlops(rows, model_dim, 3 * model_dim)
  flops += AttentionFlops(batch, seq_len, seq_len, model_dim, num_heads, causal)
  flops += FCFlops(rows, model_dim, model_dim)
  flops += FCFlops(rows, model_dim, hidden_dim, activation)
  flops += FCFlops(rows, hidden_dim, model_dim)
  flops += 2 * ElementwiseFlops(n)  # Two residual adds.
  return flops
