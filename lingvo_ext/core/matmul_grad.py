"""A MatMul gradient that avoids TensorFlow's slow transposed-RHS CPU kernel.

With oneDNN off (Lingvo needs it off), TensorFlow's Eigen MatMul repacks a
transposed right-hand side on every call. The input gradient of y = x @ W is
grad @ W^T, so each call pays a fixed cost in the size of W: single-threaded,
[32, 1536] @ [1536, 1536]^T takes 8.3 ms against 1.5 ms untransposed. That
cost dominates small micro-batches. (W @ grad^T)^T transposes only the small
operands instead and is bit-identical; here it takes 1.6 ms. Folding an
explicit tf.transpose(W) does not help: Grappler turns it back into
transpose_b.
"""

import contextlib

import lingvo.compat as tf
from tensorflow.python.ops import math_grad  # pylint: disable=g-direct-tensorflow-import

GRADIENT_NAME = 'LingvoExtCpuMatMul'


@tf.RegisterGradient(GRADIENT_NAME)
def _CpuMatMulGrad(op, grad):
  """MatMul's gradient, with grad_a = (b @ grad^T)^T when nothing transposes."""
  if (op.get_attr('transpose_a') or op.get_attr('transpose_b') or
      op.inputs[0].dtype.is_complex):
    return math_grad._MatMulGrad(op, grad)  # pylint: disable=protected-access
  a, b = op.inputs
  skip = getattr(op, 'skip_input_indices', None) or ()
  grad_a = None
  if 0 not in skip:
    grad_a = tf.transpose(tf.matmul(b, grad, transpose_b=True))
  grad_b = None
  if 1 not in skip:
    grad_b = tf.matmul(a, grad, transpose_a=True)
  return grad_a, grad_b


def IsCpuDevice(device: str) -> bool:
  """Whether ops placed on `device` run on a CPU (an empty device does)."""
  return not any(kind in device.upper() for kind in ('GPU', 'TPU'))


@contextlib.contextmanager
def CpuMatMulGradients(device: str = ''):
  """MatMuls made inside use _CpuMatMulGrad when `device` is a CPU."""
  if not IsCpuDevice(device):
    yield  # cuBLAS and XLA handle a transposed operand at no such cost.
    return
  with tf.get_default_graph().gradient_override_map({'MatMul': GRADIENT_NAME}):
    yield
