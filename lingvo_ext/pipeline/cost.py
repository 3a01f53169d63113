"""Layer costs measured in TensorFlow: metadata, parameter bytes, time.

The FLOP formulas are flops.py's (pure arithmetic). This module builds layers
in a sandbox graph: `LayerMetas` (FPropMeta through a stack), `ParamBytes`,
`ActivationBytes`, the profiler's FLOPs and `MeasureLayerTime`.

`LayerCosts` threads shapes through a flat list of layer params and returns
one cost per layer, for `flops`, `params` (parameter bytes) or `time`
(measured forward+backward seconds on a target device).
"""

import contextlib
import statistics
import time
from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Sequence

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import sympy

from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext.layers import flops
from lingvo_ext.pipeline import nest_util

COST_CHOICES = ('flops', 'params', 'time')

################################################################################
# Per-layer metadata and costs over a flat layer stack.
################################################################################


def _CheckNumeric(value, what):
  value = sympy.sympify(value)
  if not value.is_number:
    raise ValueError(
        '%s is symbolic (%s); pass input shapes with every dim known '
        '(tshape.Shape of ints) to compute layer costs.' % (what, value))
  return value


def LayerMetas(layer_params: Sequence[Any],
               *shapes) -> List[py_utils.NestedMap]:
  """Threads shapes through each layer's FPropMeta.

  Args:
    layer_params: A list of layer params, run in sequence.
    *shapes: tshape.Shape of the inputs of the first layer.

  Returns:
    One NestedMap per layer with `flops`, `in_shapes`, `out_shapes` and
    `param_shards` (the per-shard shape, bytes and device of a partitioned
    variable, from FPropMeta; empty for other layers).
  """
  metas = []
  shapes = tuple(shapes)
  for i, p in enumerate(layer_params):
    if not hasattr(p.cls, 'FPropMeta'):
      raise ValueError('layer_params[%d] (%s) has no FPropMeta; every layer '
                       'of a partitioned stack needs one.' %
                       (i, p.cls.__name__))
    meta = p.cls.FPropMeta(p, *shapes)
    out_shapes = nest_util.ToTuple(meta.out_shapes)
    metas.append(
        py_utils.NestedMap(
            flops=flops.ToInt(meta.flops),
            in_shapes=shapes,
            out_shapes=out_shapes,
            param_shards=list(meta.get('param_shards', None) or [])))
    shapes = out_shapes
  return metas


def NamedCopy(p, default_name):
  """A copy of params p, named default_name if it has no name."""
  p = p.Copy()
  if not p.name:
    p.name = default_name
  return p


@contextlib.contextmanager
def Sandbox(graph=None):
  """Makes graph (a new one by default) the default, outside any layer.

  Costs are often computed while a layer is being built (a task calls
  PartitionSequentialLayers in its __init__). Lingvo records every layer built
  during another's __init__ as that one's child; layers built here are
  throw-away, so the stack of layers under construction is set aside.

  Args:
    graph: The tf.Graph to use; a new one if None.

  Yields:
    The graph.
  """
  graph = graph or tf.Graph()
  with internal_lingvo.OutsideLayerStack(), graph.as_default():
    yield graph


def InstantiateLayer(p):
  """Instantiates p in the current graph and returns the layer."""
  layer = p.Instantiate()
  # Recent Lingvo creates variables lazily; make sure they exist.
  if hasattr(layer, 'InstantiateVariables'):
    layer.InstantiateVariables()
  return layer


def LayerVariables(p) -> List[Any]:
  """Returns the (static) shapes and dtypes of p's variables.

  Instantiates the layer in a throw-away graph; nothing is run.

  Args:
    p: A layer's params.

  Returns:
    A list of (name, shape list, tf.DType).
  """
  with Sandbox():
    layer = InstantiateLayer(NamedCopy(p, 'layer'))
    out = []
    for v in layer.vars.Flatten():
      out.append((v.name, v.shape.as_list(), v.dtype.base_dtype))
    return out


def ParamCount(p) -> int:
  """Number of parameters (variable elements) of the layer p."""
  return int(sum(int(np.prod(s)) for _, s, _ in LayerVariables(p)))


def ParamBytes(p) -> int:
  """Bytes of parameters (variable elements * dtype size) of the layer p."""
  return int(sum(int(np.prod(s)) * d.size for _, s, d in LayerVariables(p)))


def ActivationBytes(out_shapes, dtype=tf.float32) -> int:
  """Bytes of a layer's outputs, the activations a pipeline cell keeps."""
  total = 0
  for s in nest_util.ToTuple(out_shapes):
    if s is None:
      continue
    total += int(_CheckNumeric(flops.NumElements(s), 'An output shape'))
  return total * tf.as_dtype(dtype).size


def FakeInputs(p, shapes):
  """Input tensors for a layer p at shapes, for timing.

  A layer may define a classmethod `FakeInputs(p, *shapes)` (e.g. embedding
  layers, which need ids in range); containers ask their first sub-layer.

  Args:
    p: A layer's params.
    shapes: tshape.Shapes of the inputs.

  Returns:
    A tuple of tensors.
  """
  probe = p
  while not hasattr(probe.cls, 'FakeInputs') and getattr(probe, 'sub', None):
    probe = probe.sub[0]
  if hasattr(probe.cls, 'FakeInputs'):
    return nest_util.ToTuple(probe.cls.FakeInputs(probe, *shapes))
  dtype = p.dtype if hasattr(p, 'dtype') else tf.float32
  return tuple(
      tf.random.stateless_normal(
          s.ToTensorShape().as_list(), seed=[1, i], dtype=dtype)
      for i, s in enumerate(shapes))


def _InputSpecs(p, shapes):
  """(dtype, static shape list) of each input of layer p at shapes."""
  with Sandbox():
    fake = FakeInputs(p, shapes)
    return [(t.dtype, t.shape.as_list()) for t in fake]


def TfProfilerFlops(p, *shapes) -> int:
  """FLOPs TensorFlow's profiler counts in the FProp graph of layer p.

  The layer's variables are created in one graph; FProp is then built in a
  fresh graph in which theta and the inputs are placeholders, so that the
  profiled graph holds the FProp ops only (no initializers).

  Args:
    p: A layer's params.
    *shapes: tshape.Shapes of its inputs, every dim known.

  Returns:
    `total_float_ops` of tf.compat.v1.profiler.profile(...float_operation()).
  """
  for s in shapes:
    if s is not None:
      _CheckNumeric(flops.NumElements(s), 'An input shape')
  specs = _InputSpecs(p, shapes)
  with Sandbox():
    layer = InstantiateLayer(NamedCopy(p, 'layer'))
    theta_specs = layer.theta.Transform(lambda v: (v.dtype, v.shape.as_list()))
  with Sandbox() as g:
    theta = theta_specs.Transform(
        lambda spec: tf.placeholder(spec[0].base_dtype, spec[1]))
    inputs = [tf.placeholder(dtype, shape) for dtype, shape in specs]
    layer.FProp(theta, *inputs)
  opts = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
  opts['output'] = 'none'
  return int(tf.compat.v1.profiler.profile(g, options=opts).total_float_ops)


def MeasureLayerTime(p,
                     *shapes,
                     device: Optional[str] = None,
                     session_config: Optional[Any] = None,
                     num_repeats: int = 5,
                     num_warmup: int = 1,
                     subtract_overhead: bool = True) -> float:
  """Median forward+backward seconds of layer p on inputs of shapes.

  As torchgpipe's balance_by_time, the layer runs alone in a sandbox: a
  throw-away tf.Graph and Session, with inputs held in variables so that
  their generation is not timed.

  Args:
    p: A layer's params.
    *shapes: tshape.Shapes of its inputs, every dim known.
    device: Device to place the layer on, e.g. '/gpu:0'; None: TF's default.
    session_config: A tf.ConfigProto for the sandbox session.
    num_repeats: Number of timed runs (1..100); the median is returned.
    num_warmup: Untimed runs first (0..10), to leave out one-off setup.
    subtract_overhead: Whether to subtract the median time of a Session.run
      that fetches only the inputs (clamping at 0), so that small layers are
      not all charged the same fixed per-run overhead.

  Returns:
    Seconds of one forward+backward pass.
  """
  if not 1 <= num_repeats <= 100:
    raise ValueError('num_repeats=%r must be in [1, 100].' % (num_repeats,))
  if not 0 <= num_warmup <= 10:
    raise ValueError('num_warmup=%r must be in [0, 10].' % (num_warmup,))
  for s in shapes:
    if s is not None:
      _CheckNumeric(flops.NumElements(s), 'An input shape')
  with Sandbox() as g, tf.device(device):
    tf.random.set_seed(1234)
    layer = InstantiateLayer(NamedCopy(p, 'layer'))
    fake = FakeInputs(p, shapes)
    # Inputs live in variables, so that each run only reads them.
    inputs = []
    for i, t in enumerate(fake):
      v = tf.Variable(t, trainable=False, name='fake_input_%d' % i)
      inputs.append(tf.identity(v))
    outputs = nest_util.ToTuple(layer.FProp(layer.theta, *inputs))
    float_outputs = [
        o for o in outputs if o is not None and o.dtype.is_floating
    ]
    loss = tf.add_n([tf.reduce_sum(o) for o in float_outputs])
    xs = [x for x in layer.vars.Flatten()]
    xs += [x for x in inputs if x.dtype.is_floating]
    grads = []
    for grad in tf.gradients(loss, xs):
      if isinstance(grad, tf.IndexedSlices):  # E.g. of an embedding gather.
        grad = grad.values
      if grad is not None:
        grads.append(grad)
    # Fetch one scalar that depends on every gradient: Grappler prunes
    # stateless ops reached only through the control edges of a tf.group,
    # and fetching the gradients themselves would time their copy out.
    step = tf.add_n([loss] + [tf.reduce_sum(g) for g in grads])
    # The same fetch without the layer: the fixed cost of a Session.run,
    # which would otherwise be charged to every layer.
    baseline = tf.add_n([tf.reduce_sum(tf.cast(x, tf.float32))
                         for x in inputs])
    init = tf.global_variables_initializer()

  def _Median(fetch):
    for _ in range(num_warmup):
      sess.run(fetch)
    times = []
    for _ in range(num_repeats):
      start = time.perf_counter()
      sess.run(fetch)
      times.append(time.perf_counter() - start)
    return statistics.median(times)

  if session_config is None:
    # Ops without a kernel on the target device run beside it, as in training.
    session_config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
  with tf.Session(graph=g, config=session_config) as sess:
    sess.run(init)
    step_time = _Median(step)
    overhead = _Median(baseline) if subtract_overhead else 0.0
  return float(max(step_time - overhead, 0.0))


def LayerCosts(layer_params: list,
               *shapes,
               cost: str = 'flops',
               device: Optional[str] = None,
               session_config: Optional[Any] = None,
               num_repeats: int = 5,
               num_warmup: int = 1,
               measure_fn: Optional[Callable[..., float]] = None
              ) -> List[float]:
  """Per-layer costs of a sequential stack of layers.

  Args:
    layer_params: A list of layer params, run in sequence.
    *shapes: tshape.Shape of the inputs of the first layer, every dim known.
    cost: 'flops': forward FLOPs from FPropMeta; 'params': parameter bytes;
      'time': measured forward+backward seconds (see MeasureLayerTime).
    device: For 'time': device to profile on, e.g. '/gpu:0'.
    session_config: For 'time': tf.ConfigProto of the sandbox session.
    num_repeats: For 'time': timed runs per layer (1..100); median is used.
    num_warmup: For 'time': untimed runs per layer first (0..10).
    measure_fn: For 'time': replaces MeasureLayerTime (same signature).

  Returns:
    A list of floats, one cost per layer.
  """
  if cost not in COST_CHOICES:
    raise ValueError('cost=%r is not a known cost; choose one of %s.' %
                     (cost, ', '.join(COST_CHOICES)))
  if cost == 'params':
    return [float(ParamBytes(p)) for p in layer_params]
  metas = LayerMetas(layer_params, *shapes)
  if cost == 'flops':
    return [float(_CheckNumeric(m.flops, 'FLOPs of layer %d' % i))
            for i, m in enumerate(metas)]
  measure_fn = measure_fn or MeasureLayerTime
  return [
      float(
          measure_fn(
              p,
              *m.in_shapes,
              device=device,
              session_config=session_config,
              num_repeats=num_repeats,
              num_warmup=num_warmup)) for p, m in zip(layer_params, metas)
  ]
