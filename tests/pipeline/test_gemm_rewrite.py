"""Broadcasting weight matmuls run as one 2-D GEMM: same numbers, no BMM."""

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import gemm_rewrite
from tests.pipeline import test_pipeline_structures as structures
from tests.support import gpipe_testlib

T, B, D, H = 5, 8, 6, 7


def _Graphs(graph):
  """`graph` and the graphs of the functions its ops call, recursively."""
  out, todo = [], [graph]
  while todo:
    g = todo.pop()
    out.append(g)
    for op in g.get_operations():
      if op.type in ('PartitionedCall', 'StatefulPartitionedCall'):
        fg = internal_tf.FunctionGraph(op)
        if fg is not None:
          todo.append(fg)
  return out


def _LiveBroadcastMatMuls(graph):
  """Broadcasting weight BatchMatMuls whose output something reads."""
  return [op.name for g in _Graphs(graph) for op in g.get_operations()
          if gemm_rewrite.IsBroadcastWeightMatMul(op) and
          op.outputs[0].consumers()]


@pytest.mark.parametrize('static', [True, False])
def test_rewrite_equals_batch_matmul_forward_and_gradients(static):
  rng = np.random.RandomState(0)
  xv = rng.randn(T, B, D).astype(np.float32)
  wv = rng.randn(D, H).astype(np.float32)
  dyv = rng.randn(T, B, H).astype(np.float32)
  results = []
  for rewrite in (False, True):
    with tf.Graph().as_default() as g, tf.Session(graph=g) as sess:
      x = tf.placeholder(tf.float32, [T, B, D] if static else [None, None, D])
      w = tf.constant(wv)
      y = gemm_rewrite.Flattened(lambda: tf.tanh(tf.matmul(x, w)), rewrite)
      assert bool(_LiveBroadcastMatMuls(g)) != rewrite
      loss = tf.reduce_sum(y * dyv)
      results.append(sess.run([y] + tf.gradients(loss, [x, w]), {x: xv}))
      if rewrite:
        grad_types = {op.type for op in g.get_operations()
                      if 'MatMul' in op.type and 'gradients' in op.name}
        assert grad_types == {'MatMul'}, grad_types
  for a, b in zip(*results):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_other_batch_matmuls_are_left_alone():
  with tf.Graph().as_default() as g:
    a = tf.zeros([3, 4, 5])
    b = tf.zeros([3, 5, 2])
    w = tf.zeros([5, 2])
    y = gemm_rewrite.Flattened(lambda: (tf.matmul(a, b),  # Two activations.
                                        tf.matmul(a, w)))
    assert y[0].op.type in ('BatchMatMulV2', 'BatchMatMulV3')
    assert y[1].op.type == 'Reshape'
    assert len([op for op in g.get_operations() if op.type == 'MatMul']) == 1


def _Step(flat, cell_functions, num_devices=2):
  """A 3-cell FC pipeline on [T, B, D] inputs (batch_dim 1): its loss,
  gradients, the sequential model's, and live broadcasting matmuls."""
  g = tf.Graph()
  with g.as_default(), gpipe_testlib.Cluster(num_devices):
    tf.random.set_seed(1)
    py_utils.GetOrCreateGlobalStepVar()
    cells = [gpipe_testlib.Fc('fc%d' % i, D, D, seed=i) for i in range(3)]
    p = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=2, batch_dim=1,
        cell_functions=cell_functions, flat_weight_matmuls=flat)
    net = p.Instantiate()
    x = tf.constant(np.random.RandomState(0).randn(T, B, D).astype(
        np.float32))
    rng = np.random.RandomState(1)
    weights = tf.constant(rng.uniform(-1, 1, [T, B, D]).astype(np.float32))
    loss = tf.reduce_sum(net.FPropDefaultTheta(x) * weights)
    variables = net.vars.Flatten()
    grads = tf.gradients(loss, variables, colocate_gradients_with_ops=True)
    # The pipeline's step only: the sequential model's are Lingvo's own.
    live = _LiveBroadcastMatMuls(g)
    seq_loss = tf.reduce_sum(net.FPropSequential(net.theta, x) * weights)
    seq_grads = tf.gradients(seq_loss, variables)
    init = tf.global_variables_initializer()
  with gpipe_testlib.Session(g, num_devices) as sess:
    sess.run(init)
    return sess.run([loss, grads, seq_loss, seq_grads]) + [live]


@pytest.mark.parametrize('cell_functions', [True, False])
def test_pipeline_step_rewritten_equals_unrewritten(cell_functions):
  loss, grads, seq_loss, seq_grads, live = _Step(True, cell_functions)
  assert not live, live
  base_loss, base_grads, _, _, base_live = _Step(False, cell_functions)
  # Lingvo's FCLayer on [T, B, D] is a broadcasting BatchMatMul.
  assert base_live
  np.testing.assert_allclose(loss, base_loss, rtol=1e-5)
  np.testing.assert_allclose(loss, seq_loss, rtol=1e-5)
  for a, b, c in zip(grads, base_grads, seq_grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)


def test_layer_param_defaults_on():
  assert gpipe.PipeliningLayer.Params().flat_weight_matmuls is True


# Generated structures (tests/pipeline/test_pipeline_structures.py) whose inputs
# are [T, B, D] (batch_dim 1): every FC layer is a broadcasting weight matmul,
# so the rewrite runs in every cell, fetched activations, before_tpl layers
# and micro_batch_size included.
_TBD_SEEDS = (3, 8, 15)
_TBD_VARIANTS = (('unrolled', False), ('1f1b', None), ('1f1b', True),
                 ('zero_bubble', None),
                 ('unrolled', None, (('cell_functions', False),)))


def _LiveInCase(case, flat):
  """Live broadcasting weight matmuls in the case's '1f1b' pipeline step."""
  cells, num_devices, inputs_fn, loss_fn, kwargs, _ = case
  with tf.Graph().as_default() as g, gpipe_testlib.Cluster(num_devices):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, schedule='1f1b',
        flat_weight_matmuls=flat, **kwargs).Instantiate()
    tf.gradients(loss_fn(net.FPropDefaultTheta(*inputs_fn())),
                 net.vars.Flatten(), unconnected_gradients='zero')
    return _LiveBroadcastMatMuls(g)


@pytest.mark.parametrize('seed', _TBD_SEEDS)
def test_generated_tbd_pipelines_rewritten_match_sequential(seed):
  case = structures.RandomCase(seed)
  cells, num_devices, inputs_fn, loss_fn, kwargs, desc = case
  assert desc['batch_dim'] == 1, desc
  assert _LiveInCase(case, False) and not _LiveInCase(case, True)
  results, seq, names = gpipe_testlib.RunVariants(
      cells, num_devices, inputs_fn, variants=_TBD_VARIANTS,
      loss_fn=loss_fn, flat_weight_matmuls=True, **kwargs)
  gpipe_testlib.AssertVariantsMatch(results, seq, names)


def test_a_tbd_pipeline_trains_as_the_sequential_model():
  # 200 SGD steps of a 3-cell FC pipeline on [T, B, D] inputs, the weight
  # matmuls rewritten, from the same weights as the sequential model: the
  # loss curves agree at every step (float32 rounding grown by training).
  steps, lr = 200, 0.01
  curves = {}
  for schedule in ('sequential', 'unrolled', '1f1b'):
    with tf.Graph().as_default() as g, gpipe_testlib.Cluster(2):
      py_utils.GetOrCreateGlobalStepVar()
      cells = [gpipe_testlib.Fc('fc%d' % i, D, D, seed=i) for i in range(3)]
      net = gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=cells, num_micro_batches=2, batch_dim=1,
          schedule='1f1b' if schedule == 'sequential' else schedule
      ).Instantiate()
      rng = np.random.RandomState(0)
      x = tf.constant(rng.randn(T, B, D).astype(np.float32))
      target = tf.constant(rng.uniform(-1, 1, [T, B, D]).astype(np.float32))
      out = (net.FPropSequential(net.theta, x) if schedule == 'sequential'
             else net.FPropDefaultTheta(x))
      loss = tf.reduce_mean(tf.square(out - target))
      variables = net.vars.Flatten()
      grads = tf.gradients(loss, variables, colocate_gradients_with_ops=True)
      train = tf.group(*[v.assign_sub(lr * gr)
                         for v, gr in zip(variables, grads)])
      init = tf.global_variables_initializer()
    with gpipe_testlib.Session(g, 2) as sess:
      sess.run(init)
      curves[schedule] = [sess.run([loss, train])[0] for _ in range(steps)]
  seq = np.array(curves['sequential'])
  assert seq[-1] < 0.9 * seq[0], seq[[0, -1]]  # It trains.
  for schedule in ('unrolled', '1f1b'):
    np.testing.assert_allclose(curves[schedule], seq, rtol=1e-4, atol=1e-5,
                               err_msg=schedule)
