"""PipeliningLayer.check_numerics: Lingvo's NaN/Inf checks once a step.

Under 'step' (the default) the cells are built without Lingvo's checks
(`py_utils.CheckNumerics` in every FC layer, forward and gradient) and the
pipeline checks its outputs, their gradients and its inputs' gradients once
(Lingvo's learner checks the weights' gradients): a NaN or Inf made in a
cell is still caught, forward and backward, and no check is left per
micro-batch. 'cells' keeps the cells' checks; 'recurrent' always does.
"""

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
import numpy as np
import pytest

import lingvo_ext  # noqa: F401  # pylint: disable=unused-import
from lingvo_ext.core import gpipe
from tests.support import gpipe_testlib as lib

B, D = 8, 6


class _Poison(base_layer.BaseLayer):
  """x -> x + a term that is NaN where `where` says: 'forward' (its value)
  or 'backward' (its gradient: sqrt's at 0); '' neither."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('where', '', "'forward', 'backward' or ''.")
    return p

  def FProp(self, theta, x):
    where = self.params.where
    if where == 'forward':
      return x + tf.sqrt(-tf.ones_like(x))
    if where == 'backward':
      return x + tf.sqrt(x * 0.0)
    return x

  @classmethod
  def FPropMeta(cls, p, x):
    return py_utils.NestedMap(flops=x.num_elements(), out_shapes=(x,))


def _Cells(poison=''):
  """Two cells of FC layers (each with Lingvo's checks); the poison in the
  second, before its FC layer."""
  return [
      gpipe.FeatureExtractionLayer.Params().Set(
          name='cell0', sub=[lib.Fc('fc0', D, D, seed=1)]),
      gpipe.FeatureExtractionLayer.Params().Set(
          name='cell1', sub=[_Poison.Params().Set(name='poison', where=poison),
                             lib.Fc('fc1', D, D, seed=2)]),
  ]


def _Input():
  return tf.constant(np.random.RandomState(0).randn(B, D).astype(np.float32))


def _Build(poison='', num_micro=2, **kwargs):
  """(graph, loss, gradients) of a 2-device pipeline of `_Cells`."""
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    # A layer before the cells: the pipeline's inputs have a gradient.
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_Cells(poison), num_micro_batches=num_micro,
        before_tpl=[lib.Fc('before', D, D, seed=3)], **kwargs).Instantiate()
    loss = tf.reduce_sum(net.FPropDefaultTheta(_Input()))
    grads = tf.gradients(loss, net.vars.Flatten(),
                         colocate_gradients_with_ops=True)
    g.init = tf.global_variables_initializer()
  return g, loss, grads


def _Checks(g):
  """(CheckNumerics ops in the graph, those in its functions)."""
  graph_def = g.as_graph_def()
  in_graph = sum(n.op == 'CheckNumerics' for n in graph_def.node)
  in_functions = sum(n.op == 'CheckNumerics'
                     for f in graph_def.library.function for n in f.node_def)
  return in_graph, in_functions


VARIANTS = [dict(), dict(cell_functions=False), dict(schedule='1f1b')]


@pytest.mark.parametrize('kwargs', VARIANTS)
def test_no_check_per_micro_batch_under_step(kwargs):
  counts = {m: _Checks(_Build(num_micro=m, **kwargs)[0]) for m in (2, 4)}
  assert counts[2] == counts[4], counts  # None per micro-batch.
  assert counts[2][1] == 0  # None in the cell functions.
  assert counts[2][0] > 0  # The step's own.
  cells = {m: _Checks(_Build(num_micro=m, check_numerics='cells',
                             **kwargs)[0]) for m in (2, 4)}
  if kwargs.get('cell_functions', True):
    assert cells[2][1] > 0
  else:
    assert cells[4][0] > cells[2][0]


def test_recurrent_keeps_the_cells_checks():
  assert _Checks(_Build(schedule='recurrent')[0])[1] > 0


@pytest.mark.parametrize('kwargs', VARIANTS)
@pytest.mark.parametrize('poison', ['forward', 'backward'])
def test_a_nan_in_a_cell_is_caught_under_step(poison, kwargs):
  g, loss, grads = _Build(poison, **kwargs)
  with lib.Session(g, 2) as sess:
    sess.run(g.init)
    if poison == 'forward':
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match='pipe: an output'):
        sess.run(loss)
    else:
      assert np.isfinite(sess.run(loss))
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match='pipe: an input gradient'):
        sess.run(grads)


def test_enable_check_numerics_false_turns_every_check_off():
  # Lingvo reads the flag's value (py_utils_flags), parsed or not.
  flag = tf.flags.FLAGS['enable_check_numerics']
  saved = flag.value
  flag.value = False
  try:
    for mode in gpipe.CHECK_NUMERICS:
      g, loss, _ = _Build('forward', check_numerics=mode)
      assert _Checks(g) == (0, 0), mode
      with lib.Session(g, 2) as sess:
        sess.run(g.init)
        assert np.isnan(sess.run(loss))
  finally:
    flag.value = saved


@pytest.mark.parametrize('mode', gpipe.CHECK_NUMERICS)
def test_pipeline_equals_sequential(mode):
  pipe_out, seq_out, pipe_grads, seq_grads, names = (
      lib.RunPipelineAndSequential(
          _Cells(), 2, lambda: (_Input(),), num_micro_batches=4,
          check_numerics=mode))
  np.testing.assert_allclose(pipe_out, seq_out, rtol=1e-5, atol=1e-5)
  for name, pg, sg in zip(names, pipe_grads, seq_grads):
    np.testing.assert_allclose(pg, sg, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_bad_value_names_the_param():
  with lib.Cluster(2), pytest.raises(ValueError, match='check_numerics='):
    gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_Cells(), num_micro_batches=2,
        check_numerics='always').Instantiate()
