"""Helpers shared by the GPipe tests: small layers and a pipeline harness."""

import copy
import zlib

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import cluster_factory
from lingvo.core import layers
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np

from lingvo_ext import session_config
from lingvo_ext.core import gpipe


def Fc(name, input_dim, output_dim, seed):
  return layers.FCLayer.Params().Set(
      name=name, input_dim=input_dim, output_dim=output_dim,
      activation='TANH',
      params_init=py_utils.WeightInit.Gaussian(0.5, seed=seed))


class TwoStreamLayer(base_layer.BaseLayer):
  """(x, y) -> (tanh(x W) + y, y * 2): two inputs, two outputs."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Width of both streams.')
    return p

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    self.CreateVariable(
        'w', py_utils.WeightParams(
            [p.dim, p.dim], py_utils.WeightInit.Gaussian(0.5, seed=7)))

  def FProp(self, theta, x, y):
    # A named op whose runtime device the placement test inspects.
    x = tf.identity(x, name='marker_' + self.params.name)
    return tf.tanh(tf.matmul(x, theta.w)) + y, y * 2.0

  @classmethod
  def FPropMeta(cls, p, x, y):
    flops = 2 * x.num_elements() * p.dim + 2 * x.num_elements()
    return py_utils.NestedMap(flops=flops, out_shapes=(x, y))


class NestedMapLayer(base_layer.BaseLayer):
  """NestedMap(a, b) -> NestedMap(a=tanh(a W) * b, b=b + 1)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Width of both fields.')
    return p

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    self.CreateVariable(
        'w', py_utils.WeightParams(
            [p.dim, p.dim], py_utils.WeightInit.Gaussian(0.5, seed=3)))

  def FProp(self, theta, inputs):
    return py_utils.NestedMap(
        a=tf.tanh(tf.matmul(inputs.a, theta.w)) * inputs.b, b=inputs.b + 1.0)

  @classmethod
  def FPropMeta(cls, p, inputs):
    flops = 2 * inputs.a.num_elements() * p.dim
    return py_utils.NestedMap(flops=flops, out_shapes=(inputs,))


def Cluster(num_devices):
  return cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=num_devices,
      split_size=num_devices)


def BuildTrainTask(task_params):
  """A task and its training step in the default graph and cluster.

  Returns:
    (task, its loss tensor, the variable initializers).
  """
  py_utils.GetOrCreateGlobalStepVar()
  task = task_params.Instantiate()
  task.FPropDefaultTheta()
  task.BProp()
  return task, task.eval_metrics['loss'][0], [
      tf.global_variables_initializer(), tf.local_variables_initializer()]


def LoadSeededWeights(sess, variables, scale=1.0):
  """Sets each variable to 0.1 * scale * N(0, 1), seeded by its name.

  The same start whatever the layout or schedule that built the graph. One
  session run: Variable.load adds its ops and runs once per variable, and
  Grappler optimizes each of those runs anew (a third of a full-size
  experiment's test time).
  """
  feeds, assigns = {}, []
  for v in variables:
    rng = np.random.RandomState(zlib.crc32(v.op.name.encode()))
    value = (rng.randn(*v.shape.as_list()) * 0.1 * scale).astype(np.float32)
    placeholder = tf.placeholder(v.dtype.base_dtype, v.shape)
    feeds[placeholder] = value
    assigns.append(tf.assign(v, placeholder))
  sess.run(assigns, feed_dict=feeds)


def Session(graph, num_devices, optimize=True):
  """A session on num_devices CPUs.

  optimize=False turns Grappler off, for tests whose assertions are about
  variable values and checkpoints rather than the computation: optimizing a
  small pipeline's graph and cell functions is about a third of the CPU time
  of its first runs. Either way, without the Grappler passes the trainer's
  sessions skip (session_config.WithoutIdlePasses).
  """
  config = session_config.WithoutIdlePasses(tf.config_pb2.ConfigProto(
      device_count={'CPU': num_devices}, inter_op_parallelism_threads=2,
      intra_op_parallelism_threads=1))
  if not optimize:
    config.graph_options.rewrite_options.disable_meta_optimizer = True
  return tf.Session(graph=graph, config=config)


def _Loss(outputs, seed=0):
  """A loss with distinct weights per element, so every gradient counts."""
  rng = np.random.RandomState(seed)
  flat = [t for t in tf.nest.flatten(outputs) if t is not None]
  return tf.add_n([
      tf.reduce_sum(t * tf.constant(
          rng.uniform(-1, 1, t.shape.as_list()).astype(np.float32)))
      for t in flat
  ])


def RunPipelineAndSequential(cell_tpl, num_devices, inputs_fn, **pipe_kwargs):
  """Builds both models on shared weights; returns their outputs and grads.

  Returns:
    (pipe_out, seq_out, pipe_grads, seq_grads, var_names) as numpy values.
  """
  g = tf.Graph()
  with g.as_default(), Cluster(num_devices):
    tf.random.set_seed(1)
    py_utils.GetOrCreateGlobalStepVar()
    p = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cell_tpl, **pipe_kwargs)
    net = p.Instantiate()
    args = inputs_fn()
    pipe_out = net.FPropDefaultTheta(*args)
    seq_out = net.FPropSequential(net.theta, *args)
    variables = net.vars.Flatten()
    pipe_grads = tf.gradients(_Loss(pipe_out), variables,
                              colocate_gradients_with_ops=True)
    seq_grads = tf.gradients(_Loss(seq_out), variables)
    init = tf.global_variables_initializer()
  with Session(g, num_devices) as sess:
    sess.run(init)
    res = sess.run([pipe_out, seq_out, pipe_grads, seq_grads])
  return res + [[v.name for v in variables]]


# (schedule, recompute) pairs the tests run; every one must equal the
# sequential model. 'recurrent' always recomputes; '1f1b' does only when the
# loss needs it (the default loss here is linear in the outputs: it does not).
VARIANTS = (('unrolled', False), ('unrolled', True), ('1f1b', None),
            ('recurrent', True))


def Variant(net, schedule, recompute, extra=()):
  """`net` with other schedule params, on the same weights and cells.

  Args:
    net: The PipeliningLayer.
    schedule: Its `schedule`.
    recompute: Its `recompute`.
    extra: (param name, value) pairs of other PipeliningLayer params.

  Returns:
    A shallow copy of `net` with those params.
  """
  v = copy.copy(net)
  p = net.params.Copy()
  p.schedule = schedule
  p.recompute = recompute
  for key, value in extra:
    p.Set(**{key: value})
  v._params = p  # pylint: disable=protected-access
  return v


def _ResetAccumulators(net):
  # Each variant is its own FProp of the same layers in one graph: as in a
  # graph of its own, accumulators start from their default values.
  for acc in net.accumulators.Flatten():
    acc.Reset()


def RunVariants(cell_tpl, num_devices, inputs_fn, variants=VARIANTS,
                loss_fn=None, **pipe_kwargs):
  """Builds every (schedule, recompute) variant and the sequential model.

  All share one graph, one set of weights and one session run.

  Args:
    cell_tpl: The cells.
    num_devices: Devices in the split.
    inputs_fn: Returns the FProp inputs.
    variants: (schedule, recompute) pairs.
    loss_fn: outputs -> scalar loss (default: every output, distinct weights).
    **pipe_kwargs: Other PipeliningLayer params.

  Returns:
    (results, seq, var_names): results maps each variant to (outputs,
    gradients of every variable), seq is the sequential model's (outputs,
    gradients), as numpy values.
  """
  loss_fn = loss_fn or _Loss
  g = tf.Graph()
  with g.as_default(), Cluster(num_devices):
    tf.random.set_seed(1)
    py_utils.GetOrCreateGlobalStepVar()
    p = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cell_tpl, **pipe_kwargs)
    net = p.Instantiate()
    args = inputs_fn()
    variables = net.vars.Flatten()
    fetches = {}
    for variant in variants:
      _ResetAccumulators(net)
      out = Variant(net, *variant).FProp(net.theta, *args)
      grads = tf.gradients(loss_fn(out), variables,
                           colocate_gradients_with_ops=True,
                           unconnected_gradients='zero')
      fetches[variant] = (out, grads)
    _ResetAccumulators(net)
    seq_out = net.FPropSequential(net.theta, *args)
    seq = (seq_out, tf.gradients(loss_fn(seq_out), variables,
                                 unconnected_gradients='zero'))
    init = tf.global_variables_initializer()
  with Session(g, num_devices) as sess:
    sess.run(init)
    results, seq = sess.run([fetches, seq])
  return results, seq, [v.name for v in variables]


def AssertVariantsMatch(results, seq, names, atol=1e-5):
  """Every variant's outputs and every gradient equal the reference's."""
  for variant, (out, grads) in results.items():
    for a, b in zip(tf.nest.flatten(out), tf.nest.flatten(seq[0])):
      np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5,
                                 err_msg=str(variant))
    assert len(grads) == len(seq[1]) == len(names)
    for name, a, b in zip(names, grads, seq[1]):
      np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5,
                                 err_msg='%s %s' % (variant, name))


def AssertAllClose(a, b, atol=1e-5):
  fa, fb = tf.nest.flatten(a), tf.nest.flatten(b)
  assert len(fa) == len(fb)
  for x, y in zip(fa, fb):
    np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5)


def Shape(*dims):
  return tshape.Shape(list(dims))
