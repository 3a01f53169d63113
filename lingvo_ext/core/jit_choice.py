"""`jit_compile='auto'`: the faster build of a pipeline, by measurement.

XLA fuses a cell's few-microsecond ops (a Transformer's step gains about
1.5x) but its GEMMs can lose to TensorFlow's own kernels (a wide FC model).
Which wins depends on the model and the machine, so 'auto' times both:
the pipeline is built twice in graphs of its own, with `jit_compile` False
and True, on inputs shaped as the real ones, and a few training steps
(forward and backward) of each run alternately; XLA is taken when its
lowest step time is at least 5% below the other's. The choice is cached in
`$XDG_CACHE_HOME/lingvo_ext/jit_compile.json` (default ~/.cache), keyed by
the layer's params, the input shapes, the mode and the machine (CPU model,
cores, TensorFlow version, oneDNN setting), so a model rebuilt on the same
machine takes the same build without timing it again; deleting the file
measures again; processes building the same model at once measure it once
(a lock file per model beside the cache). Either build draws the same
dropout masks (jit_random.py). The trainer's --jit_compile=auto sets 'auto'
for long runs (runtime/jit_default.py).
"""

import hashlib
import os
import platform
import re
import threading
import time
from typing import Optional

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
import tensorflow as tf2

from lingvo_ext.pipeline import nest_util
from lingvo_ext.pipeline import records
from lingvo_ext import session_config
from lingvo_ext import cache_files
from lingvo_ext import xla_cache

# None: unset, built as False; the trainer's --jit_compile sets it in a local
# training run (runtime/jit_default.py).
VALUES = (False, True, 'auto', None)
_CACHE_FILE = 'jit_compile.json'
# Steps each build runs before timing (the first compiles), then timed ones,
# alternating between the builds so a load on the machine hits both.
_WARMUP_STEPS = 2
_TIMED_ROUNDS = 5
# How long a process waits for another measuring the same model.
_LOCK_WAIT_S = 600
# XLA is taken when its step is at most this fraction of TensorFlow's: each
# process compiles its cells again, and a closer race is within the timing's
# noise.
XLA_MARGIN = 0.95


def Normalize(name: str, value):
  """True, False, 'auto' or None (unset); 'True' and 'False' (as an override
  of an 'auto' param parses them) as bools. Raises ValueError for anything
  else."""
  text = {'True': True, 'False': False, 'None': None}
  if isinstance(value, str) and value in text:
    return text[value]
  if value is True or value is False or value is None or value == 'auto':
    return value
  raise ValueError("%s: jit_compile=%r; use True, False or 'auto'." %
                   (name, value))


def CheckValue(name: str, value) -> None:
  """Raises ValueError unless `value` is a jit_compile value."""
  Normalize(name, value)


def CachePath() -> str:
  """Where 'auto' keeps its choices."""
  return os.path.join(xla_cache.CacheRoot(), _CACHE_FILE)


def Machine() -> str:
  """What a measured choice depends on besides the model."""
  model = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      names = [l.split(':', 1)[1].strip() for l in f if
               l.startswith('model name')]
    model = names[0] if names else model
  except OSError:
    pass
  # The key tells CPUs of one model name with other instruction sets apart.
  return '%s x%d (cpu %s), TF %s, oneDNN=%s' % (
      model, os.cpu_count() or 1, xla_cache.CpuKey(), tf2.__version__,
      os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'default'))


def Signature(params, args, do_eval: bool, num_devices: int) -> str:
  """The cache key of a pipeline built from `params` on inputs like `args`."""
  p = params.Copy().Set(jit_compile=False)
  shapes = [None if t is None else (t.dtype.name, str(t.shape))
            for t in nest_util.Flat(args)]
  text = '\n'.join([p.ToText(), repr(shapes), 'eval=%s' % do_eval,
                    'devices=%d' % num_devices, Machine()])
  return hashlib.sha256(text.encode()).hexdigest()[:24]


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


def _InOwnThread(fn, cluster):
  """fn() in a thread of its own, under `cluster`.

  The graph being built when 'auto' resolves has contexts of its own on
  Lingvo's thread-local stacks (its global step, step seeds, variable
  scopes); the probe's graphs must not see them.
  """
  result = {}

  def Run():
    try:
      with cluster:
        result['value'] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      result['error'] = e

  thread = threading.Thread(target=Run, name='jit_compile_auto')
  thread.start()
  thread.join()
  if 'error' in result:
    raise result['error']
  return result['value']


# An op with no kernel where it is placed (in an XLA cell: one XLA cannot
# compile): the step fails the same way each time it runs.
_CANNOT_RUN = re.compile(
    r"No registered '[^']+' OpKernel|Detected unsupported operations when "
    r'trying to compile|Cannot assign a device for operation')


def CannotRunCause(error) -> Optional[str]:
  """The line of TensorFlow's `error` naming an op with no kernel where it is
  placed, trimmed to its ops; None if the error is not that."""
  text = str(getattr(error, 'message', error))
  match = _CANNOT_RUN.search(text)
  if not match:
    return None
  start = text.rfind('\n', 0, match.start()) + 1
  end = text.find('\n', match.start())
  cause = text[start:] if end < 0 else text[start:end]
  # XLA's line goes on with each op's kernel lookup: its ops are enough.
  cause = re.split(r' \(No registered|\{\{', cause)[0].strip()
  return re.sub(r'^\(\d+\) [A-Z_]+: ', '', cause)  # One of several errors.


def _Cause(error) -> str:
  """The line of TensorFlow's error that names what failed."""
  cause = CannotRunCause(error)
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


def Resolve(layer, args, fprop) -> bool:
  """The layer's jit_compile as a bool: 'auto' taken from cache or timing,
  None (unset) as False. `fprop`: PipeliningLayer.FProp (see _Build)."""
  p = layer.params
  value = Normalize(p.name, p.jit_compile)
  if value != 'auto':
    return bool(value)
  if records.Get(p.schedule).generator is None:
    return False  # Lingvo's own loop ('recurrent'): no cell functions.
  unknown = [t.shape for t in nest_util.Flat(args)
             if t is not None and not t.shape.is_fully_defined()]
  if unknown:
    # E.g. a time axis trimmed per batch: XLA would compile again for each
    # new length, and the timing has no shape to build.
    tf.logging.info(
        "%s: jit_compile='auto' took False: an input's shape is not known "
        'when the graph is built (%s); XLA would compile again per shape.',
        p.name, unknown[0])
    return False
  num_devices = layer.cluster.num_devices_per_split
  key = Signature(p, args, layer.do_eval, num_devices)
  path = CachePath()
  with cache_files.Lock('%s.%s.lock' % (path, key), _LOCK_WAIT_S):
    entry, how = _CachedOrMeasured(layer, args, key, path, fprop, num_devices)
  if entry.get('xla_error'):
    tf.logging.info(
        "%s: jit_compile='auto' took False: XLA cannot compile the cells "
        '(%s); %.1f ms per step without (%s %s).', p.name,
        entry['xla_error'], entry['ms_tf'], how, path)
  else:
    tf.logging.info(
        "%s: jit_compile='auto' took %s: %.1f ms per step with XLA, %.1f "
        'without (%s %s).', p.name, entry['jit_compile'], entry['ms_xla'],
        entry['ms_tf'], how, path)
  return bool(entry['jit_compile'])


def _CachedOrMeasured(layer, args, key, path, fprop, num_devices):
  """(cache entry, how it was had): read, else measured and written."""
  p = layer.params
  entry = cache_files.Read(path).get(key)
  how = 'cached in'
  if entry is None:
    # Shapes only: the probe's graphs cannot hold the caller's tensors.
    like = tf.nest.map_structure(
        lambda t: None if t is None else tf2.TensorSpec(t.shape, t.dtype), args)
    # The probe runs in a local session: the same split on local devices.
    cluster = cluster_factory.ForTestingWorker(
        mode='sync', job='trainer_client', cpus=num_devices,
        split_size=num_devices, do_eval=layer.do_eval)
    ms = _InOwnThread(
        lambda: Measure(p, like, layer.do_eval, num_devices, fprop), cluster)
    entry = dict(jit_compile=(ms[True] is not None and
                              ms[True] <= XLA_MARGIN * ms[False]),
                 ms_xla=ms[True], ms_tf=ms[False], machine=Machine())
    if ms.get('xla_error'):
      entry['xla_error'] = ms['xla_error']
    cache_files.Add(path, key, entry)
    how = 'measured now, cached in'
  return entry, how
