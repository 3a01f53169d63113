"""'auto''s measurement: a pipeline's step timed with and without XLA.

The pipeline is built twice in graphs of its own, with `jit_compile` False
and True, on inputs shaped as the real ones, and a few training steps
(forward and backward) of each run alternately; XLA is taken when its
lowest step time is at least 5% below the other's (jit_choice.XLA_MARGIN).
The choice goes to jit_choice's cache; processes measuring the same model
at once measure it once (a lock file per model beside the cache). Either
build draws the same dropout masks (pipeline/jit_random.py). Called before
the model is built (runtime/jit_resolve.py), never from a layer's FProp.
"""

import time

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
import tensorflow as tf2

from lingvo_ext import cache_files
from lingvo_ext import session_config
from lingvo_ext.core import jit_choice
from lingvo_ext.pipeline import nest_util

# Steps each build runs before timing (the first compiles), then timed ones,
# alternating between the builds so a load on the machine hits both.
_WARMUP_STEPS = 2
_TIMED_ROUNDS = 5
# How long a process waits for another measuring the same model.
_LOCK_WAIT_S = 600


def _Like(t):
  """Zeros shaped and typed as `t`, held in a variable.

  Zeros read as valid ids, as unpadded paddings (Lingvo's layers assert
  paddings are 0 or 1) and as data; a variable, so that Grappler does not
  fold the first layers' ops into constants and leave them out of the step.
  """
  if t is None:
    return None
  return tf.Variable(tf.zeros(t.shape.as_list(), t.dtype), trainable=False,
                     name='jit_choice_input')


def _Build(params, args, jit: bool, do_eval: bool, num_devices: int, fprop):
  """(session, step op) of the pipeline built with `jit`, in its own graph.

  `fprop`: PipeliningLayer.FProp, the pipeline's own, which took `args` (a
  subclass's, e.g. GPipeTransformerStack's with its embedding and softmax,
  takes others).
  """
  g = tf.Graph()
  # Placed as Lingvo's runners place the model: Grappler fuses placed ops.
  with g.as_default(), tf.device(cluster_factory.Current().GetPlacer()):
    py_utils.GetOrCreateGlobalStepVar()
    net = params.Copy().Set(jit_compile=jit).Instantiate()
    inputs = tf.nest.map_structure(_Like, args)
    out = fprop(net, net.theta, *nest_util.ToTuple(inputs))
    loss = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32))
                     for t in nest_util.Flat(out)
                     if t is not None and t.dtype.is_floating])
    fetch = [loss]
    if not do_eval:
      fetch += [t for t in tf.gradients(loss, net.vars.Flatten())
                if t is not None]
    init = tf.global_variables_initializer()
  # The trainer's session config: its graph optimizations shape what XLA
  # compiles, so the compiled cells are the ones its compile cache serves the
  # trainer's own session (xla_cache.py).
  config = session_config.LocalSessionConfig(max(num_devices, 1))
  sess = tf.Session(graph=g, config=config)
  sess.run(init)
  return sess, fetch


def _Cause(error) -> str:
  """The line of TensorFlow's error that names what failed."""
  cause = jit_choice.CannotRunCause(error)
  if cause:
    return cause
  lines = [l.strip() for l in str(error.message).splitlines() if l.strip()]
  useful = [l for l in lines if l not in ('Graph execution error:',) and
            not l.startswith('From /job')]
  return (useful or lines or [type(error).__name__])[0]


def Measure(params, args, do_eval: bool, num_devices: int, fprop):
  """{False: ms, True: ms}: each build's lowest step time. Where XLA cannot
  compile a cell (an op with no XLA kernel), True is None and 'xla_error'
  holds the first line of TensorFlow's error."""
  built = {False: _Build(params, args, False, do_eval, num_devices, fprop)}
  out = {True: None}
  try:
    try:
      built[True] = _Build(params, args, True, do_eval, num_devices, fprop)
      built[True][0].run(built[True][1])  # Compiles.
    except tf.errors.OpError as e:
      out['xla_error'] = _Cause(e)
      if True in built:
        built.pop(True)[0].close()
    for sess, step in built.values():
      for _ in range(_WARMUP_STEPS):
        sess.run(step)
    best = {jit: float('inf') for jit in built}
    for _ in range(_TIMED_ROUNDS):
      for jit, (sess, step) in built.items():
        start = time.perf_counter()
        sess.run(step)
        best[jit] = min(best[jit], 1e3 * (time.perf_counter() - start))
    out.update(best)
    return out
  finally:
    for sess, _ in built.values():
      sess.close()


def CachedOrMeasured(params, args, do_eval: bool, num_devices: int, fprop,
                     measure=None):
  """(cache entry, how it was had) of a pipeline of `params` on inputs like
  `args`: read from jit_choice's cache, else measured now (on a local
  cluster of `num_devices` CPU devices) and written. `measure`: Measure (a
  test's stand-in)."""
  measure = measure or Measure
  key = jit_choice.Signature(params, args, do_eval, num_devices)
  path = jit_choice.CachePath()
  with cache_files.Lock('%s.%s.lock' % (path, key), _LOCK_WAIT_S):
    entry = cache_files.Read(path).get(key)
    if entry is not None:
      return entry, 'cached in'
    # Shapes only: the timing's graphs cannot hold the caller's tensors.
    like = tf.nest.map_structure(
        lambda t: None if t is None else tf2.TensorSpec(t.shape, t.dtype), args)
    # The timing runs in a local session: the same split on local devices.
    cluster = cluster_factory.ForTestingWorker(
        mode='sync', job='trainer_client', cpus=num_devices,
        split_size=num_devices, do_eval=do_eval)
    with cluster:
      ms = measure(params, like, do_eval, num_devices, fprop)
    entry = dict(jit_compile=(ms[True] is not None and
                              ms[True] <= jit_choice.XLA_MARGIN * ms[False]),
                 ms_xla=ms[True], ms_tf=ms[False], machine=jit_choice.Machine())
    if ms.get('xla_error'):
      entry['xla_error'] = ms['xla_error']
    cache_files.Add(path, key, entry)
    return entry, 'measured now, cached in'
