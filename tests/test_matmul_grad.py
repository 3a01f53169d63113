"""The CPU MatMul gradient equals TensorFlow's, and applies on CPU only."""

import lingvo_ext  # pylint: disable=unused-import
import lingvo.compat as tf
import numpy as np
import pytest

from lingvo_ext.core import matmul_grad


def _Grads(transpose_a, transpose_b, override):
  rng = np.random.RandomState(0)
  a_shape = [5, 3] if transpose_a else [3, 5]
  b_shape = [4, 5] if transpose_b else [5, 4]
  with tf.Graph().as_default() as g, tf.Session(graph=g) as sess:
    a = tf.constant(rng.randn(*a_shape).astype(np.float32))
    b = tf.constant(rng.randn(*b_shape).astype(np.float32))
    if override:
      with matmul_grad.CpuMatMulGradients('/cpu:0'):
        y = tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
      assert y.op.get_attr('_gradient_op_type') == (
          matmul_grad.GRADIENT_NAME.encode())
    else:
      y = tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    w = tf.constant(rng.randn(3, 4).astype(np.float32))
    loss = tf.reduce_sum(y * w)
    return sess.run(tf.gradients(loss, [a, b]) + tf.gradients(loss, [a]) +
                    tf.gradients(loss, [b]))


@pytest.mark.parametrize('transpose_a', [False, True])
@pytest.mark.parametrize('transpose_b', [False, True])
def test_same_gradients_as_tensorflow(transpose_a, transpose_b):
  ours = _Grads(transpose_a, transpose_b, override=True)
  theirs = _Grads(transpose_a, transpose_b, override=False)
  for x, y in zip(ours, theirs):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_not_applied_on_gpu():
  with tf.Graph().as_default():
    with matmul_grad.CpuMatMulGradients('/job:w/replica:0/task:0/device:GPU:1'):
      y = tf.matmul(tf.ones([2, 2]), tf.ones([2, 2]))
    with pytest.raises(ValueError):
      y.op.get_attr('_gradient_op_type')
  assert matmul_grad.IsCpuDevice('')
  assert matmul_grad.IsCpuDevice('/job:localhost/replica:0/task:0/device:CPU:1')
