"""The pipeline MatMul gradient equals TensorFlow's, batched or not."""

import lingvo.compat as tf
import numpy as np
import pytest

from lingvo_ext.pipeline import matmul_grad


def _Grads(transpose_a, transpose_b, override, transposed_dx=True):
  rng = np.random.RandomState(0)
  a_shape = [5, 3] if transpose_a else [3, 5]
  b_shape = [4, 5] if transpose_b else [5, 4]
  with tf.Graph().as_default() as g, tf.Session(graph=g) as sess:
    a = tf.constant(rng.randn(*a_shape).astype(np.float32))
    b = tf.constant(rng.randn(*b_shape).astype(np.float32))
    if override:
      with matmul_grad.PipelineMatMulGradients('/cpu:0'):
        y = tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
      assert y.op.get_attr('_gradient_op_type') == (
          matmul_grad.PIPELINE_GRADIENT_NAME.encode())
    else:
      y = tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    w = tf.constant(rng.randn(3, 4).astype(np.float32))
    loss = tf.reduce_sum(y * w)
    saved = matmul_grad.TransposedInputGradPays
    matmul_grad.TransposedInputGradPays = lambda: transposed_dx
    try:
      grads = (tf.gradients(loss, [a, b]) + tf.gradients(loss, [a]) +
               tf.gradients(loss, [b]))
    finally:
      matmul_grad.TransposedInputGradPays = saved
    return sess.run(grads)


@pytest.mark.parametrize('transposed_dx', [False, True])
@pytest.mark.parametrize('transpose_a', [False, True])
@pytest.mark.parametrize('transpose_b', [False, True])
def test_same_gradients_as_tensorflow(transpose_a, transpose_b,
                                      transposed_dx):
  ours = _Grads(transpose_a, transpose_b, True, transposed_dx)
  theirs = _Grads(transpose_a, transpose_b, override=False)
  for x, y in zip(ours, theirs):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_batcher_computes_one_weight_gradient_for_all_micro_batches():
  rng = np.random.RandomState(0)
  with tf.Graph().as_default() as g, tf.Session(graph=g) as sess:
    w = tf.constant(rng.randn(5, 4).astype(np.float32))
    u = tf.constant(rng.randn(4, 4).astype(np.float32))
    xs = [tf.constant(rng.randn(3, 5).astype(np.float32)) for _ in range(3)]
    ys = []
    with matmul_grad.PipelineMatMulGradients():
      for x in xs:
        h = tf.matmul(x, tf.identity(w))  # Layers read weights via Identity.
        ys.append(tf.matmul(tf.tanh(h), h, transpose_a=True) + u)
    dys = [tf.constant(rng.randn(4, 4).astype(np.float32)) for _ in ys]
    batcher = matmul_grad.WeightGradientBatcher([w, u])
    with batcher:
      ours = tf.gradients(ys, xs + [w, u], grad_ys=dys)
    batched = batcher.Gradients([w, u])
    # The weight's MatMul gradients were held back, one MatMul computes them.
    assert batched[1] is None
    assert batched[0].op.type == 'MatMul'
    assert batched[0].op.inputs[0].op.type == 'ConcatV2'
    ours_w = batched[0] if ours[3] is None else ours[3] + batched[0]
    theirs = tf.gradients(ys, xs + [w, u], grad_ys=dys)
    a, b = sess.run([ours[:3] + [ours_w, ours[4]], theirs])
  for x, y in zip(a, b):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_transposed_dx_only_with_eigen_kernels():
  from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
  assert matmul_grad.TransposedInputGradPays() == (
      not _pywrap_util_port.IsMklEnabled())
  assert matmul_grad.IsCpuDevice('')
  assert matmul_grad.IsCpuDevice('/job:localhost/replica:0/task:0/device:CPU:1')
  assert not matmul_grad.IsCpuDevice('/job:w/replica:0/task:0/device:GPU:1')
