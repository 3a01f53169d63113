"""Training through the pipeline: every schedule follows the sequential model.

A 2-cell MLP classifier on scikit-learn's digits, 4 micro-batches, trained
200 SGD steps from the same weights under every schedule and as the plain
sequential model: the loss curves agree at every step, to 1e-12 in float64
(measured: at most 3e-14) and to 1e-4 in float32 (measured: at most 7e-6),
so nothing (gradients, seeds, accumulators, weight-gradient batching) drifts
over training. A wrong gradient shows at once: with cell 0's gradient
doubled the float32 curve is 1.37 off within 50 steps.
"""


import lingvo.compat as tf
from lingvo.core import layers
from lingvo.core import py_utils
import numpy as np
import pytest
from sklearn import datasets

from lingvo_ext.core import gpipe
from tests.support import gpipe_testlib as lib

STEPS, BATCH, HIDDEN, CLASSES = 200, 32, 32, 10
VARIANTS = (
    ('sequential', None, ()),
    ('unrolled', None, ()),
    ('unrolled', True, ()),
    ('1f1b', None, ()),
    ('recurrent', None, ()),
    # Two cells in a V on one device; the loss (after the pipeline) is not
    # linear in its outputs: every forward pass first.
    ('zbv', None, ()),
    # Cells built inline (a copy per micro-batch; functions are the default).
    ('unrolled', None, (('cell_functions', False),)),
)


def _Data():
  digits = datasets.load_digits()
  x = (digits.data / 16.).astype(np.float64)
  y = digits.target.astype(np.int32)
  return x, y


def _Cells(dtype):
  def Fc(name, i, o, seed, act='TANH'):
    return layers.FCLayer.Params().Set(
        name=name, input_dim=i, output_dim=o, activation=act, dtype=dtype,
        params_init=py_utils.WeightInit.Gaussian(1. / np.sqrt(i), seed=seed))
  cell0 = [Fc('fc0', 64, HIDDEN, 1), Fc('fc1', HIDDEN, HIDDEN, 2)]
  cell1 = [Fc('fc2', HIDDEN, HIDDEN, 3),
           Fc('logits', HIDDEN, CLASSES, 4, act='NONE')]
  return [gpipe.FeatureExtractionLayer.Params().Set(name='cell%d' % c, sub=s)
          for c, s in enumerate((cell0, cell1))]


def _Train(variant, dtype, x, y):
  schedule, recompute, extra = variant
  devices = 1 if schedule == 'zbv' else 2  # 'zbv': two cells on a device.
  g = tf.Graph()
  with g.as_default(), lib.Cluster(devices):
    tf.random.set_seed(1)
    step = py_utils.GetOrCreateGlobalStepVar()
    p = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_Cells(dtype), num_micro_batches=4,
        schedule='unrolled' if schedule == 'sequential' else schedule,
        recompute=recompute, dtype=dtype)
    for key, value in extra:
      p.Set(**{key: value})
    net = p.Instantiate()
    xs = tf.placeholder(dtype, [BATCH, 64])
    ys = tf.placeholder(tf.int32, [BATCH])
    if schedule == 'sequential':
      logits = net.FPropSequential(net.theta, xs)
    else:
      logits = net.FPropDefaultTheta(xs)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=ys, logits=logits))
    variables = net.vars.Flatten()
    grads = tf.gradients(loss, variables, colocate_gradients_with_ops=True)
    train = tf.group([tf.assign_sub(v, 0.5 * dv)
                      for v, dv in zip(variables, grads)] +
                     [tf.assign_add(step, 1)])
    init = tf.global_variables_initializer()
  losses = []
  rng = np.random.RandomState(0)
  order = rng.randint(0, len(x), size=(STEPS, BATCH))
  with lib.Session(g, devices) as sess:
    sess.run(init)
    for idx in order:
      losses.append(sess.run([loss, train], {xs: x[idx], ys: y[idx]})[0])
  return np.array(losses)


# The quick tier trains in float64; float32 is a further case (slow).
@pytest.mark.parametrize('dtype,atol', [
    (tf.float64, 1e-12),
    pytest.param(tf.float32, 1e-4, marks=pytest.mark.slow)])
def test_200_steps_follow_the_sequential_model(dtype, atol):
  x, y = _Data()
  curves = {v: _Train(v, dtype, x, y) for v in VARIANTS}
  ref = curves[VARIANTS[0]]
  assert ref[-20:].mean() < 0.5 * ref[:20].mean()  # It learns.
  for variant, curve in curves.items():
    np.testing.assert_allclose(curve, ref, rtol=0, atol=atol,
                               err_msg=str(variant))
