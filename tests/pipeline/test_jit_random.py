"""XLA-compiled draws equal TensorFlow's kernels' (pipeline/jit_random.py)."""

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
import numpy as np
import pytest
import tensorflow as tf2

from lingvo_ext.pipeline import cell_function
from lingvo_ext.pipeline import jit_random


def _Draws(shapes, rewrite):
  """Each shape's stateless_uniform, by the TF kernel and compiled by XLA."""
  def Body(*seeds):
    first = len(tf.get_default_graph().get_operations())
    out = [tf.random.stateless_uniform(s, seed=seed)
           for s, seed in zip(shapes, seeds)]
    if rewrite:
      jit_random.MatchStatelessUniforms(
          tf.get_default_graph().get_operations()[first:])
    return out

  with tf.Graph().as_default() as g:
    # Fed, not constants Grappler would fold with TF's kernel.
    seeds = [tf.placeholder(tf.int64, [2]) for _ in shapes]
    plain = Body(*seeds)
    compiled = tf2.function(Body, jit_compile=True, autograph=False)(*seeds)
  with tf.Session(graph=g) as sess:
    return sess.run([plain, compiled], {
        seed: [7, 123456789 + i] for i, seed in enumerate(seeds)})


@pytest.mark.parametrize('rewrite', [True, False])
def test_compiled_uniform_draws_equal_tensorflows_with_the_rewrite(rewrite):
  shapes = ([4, 1000], [3, 5], [7], [2, 3, 5])
  plain, compiled = _Draws(shapes, rewrite)
  for a, b in zip(plain, compiled):
    assert a.dtype == b.dtype == np.float32
    assert 0.0 <= a.min() and a.max() < 1.0
    # Bit for bit with the rewrite; XLA's own conversion differs.
    assert np.array_equal(a, b) == rewrite


class _NoiseLayer(base_layer.BaseLayer):
  """x + a stateless normal draw: no rewrite makes XLA's draw TF's."""

  def FProp(self, theta, x):
    seed = tf.cast(tf.stack([py_utils.GetGlobalStep(), 5]), tf.int64)
    return x + tf.random.stateless_normal(tf.shape(x), seed=seed)


def test_a_cell_drawing_what_xla_draws_otherwise_is_built_uncompiled():
  with tf.Graph().as_default() as g:
    py_utils.GetOrCreateGlobalStepVar()
    cell = _NoiseLayer.Params().Set(name='noise').Instantiate()
    x = tf.ones([2, 3])
    step = tf.constant(4.0)
    plain = cell_function.CellFunction(cell, 'plain')(cell.theta, (x,), step)
    jit_fn = cell_function.CellFunction(cell, 'jit', jit_compile=True)
    jitted = jit_fn(cell.theta, (x,), step)
    assert jit_random.UnmatchedRandomOps(
        jit_fn._fn.get_concrete_function(  # pylint: disable=protected-access
            *jit_fn._Args(cell.theta, (x,), step)[0]).graph) == [  # pylint: disable=protected-access
                'StatelessRandomNormalV2']
    assert not jit_fn._jit_compile  # pylint: disable=protected-access
    init = tf.global_variables_initializer()
  with tf.Session(graph=g) as sess:
    sess.run(init)
    a, b = sess.run([plain, jitted])
  np.testing.assert_array_equal(a, b)
