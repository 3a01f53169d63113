"""`jit_compile` values, and the cache of 'auto''s measured choices.

XLA fuses a cell's few-microsecond ops (a Transformer's step gains about
1.5x) but its GEMMs can lose to TensorFlow's own kernels (a wide FC model).
Which wins depends on the model and the machine, so 'auto' is the faster
build by measurement. The runtime measures, before the model is built
(runtime/jit_measure.py, runtime/jit_resolve.py), and writes the choice to
`$XDG_CACHE_HOME/lingvo_ext/jit_compile.json` (default ~/.cache), keyed by
the layer's params, the input shapes, the mode and the machine (CPU model,
cores, TensorFlow version, oneDNN setting); the trainer hands the layer a
bool. Building the layer never measures: an 'auto' left to the build
(`AtBuild`) takes the cached choice, else builds without XLA.
"""

import hashlib
import os
import platform
import re
from typing import Optional

import lingvo.compat as tf
import tensorflow as tf2

from lingvo_ext import cache_files
from lingvo_ext import xla_cache
from lingvo_ext.pipeline import nest_util
from lingvo_ext.pipeline import records

# None: unset, built as False; the trainer's --jit_compile sets it in a local
# training run (runtime/jit_default.py).
VALUES = (False, True, 'auto', None)
_CACHE_FILE = 'jit_compile.json'
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
  """The cache key of a pipeline built from `params` on inputs like `args`
  (tensors or TensorSpecs)."""
  p = params.Copy().Set(jit_compile=False)
  shapes = [None if t is None else (t.dtype.name, str(t.shape))
            for t in nest_util.Flat(args)]
  text = '\n'.join([p.ToText(), repr(shapes), 'eval=%s' % bool(do_eval),
                    'devices=%d' % num_devices, Machine()])
  return hashlib.sha256(text.encode()).hexdigest()[:24]


def Unmeasurable(params, args) -> Optional[str]:
  """Why 'auto' takes False without measuring a pipeline of `params` on
  inputs like `args`; None if it can be measured."""
  if records.Get(params.schedule).generator is None:
    return "Lingvo's own loop ('recurrent') has no cell functions"
  unknown = [t.shape for t in nest_util.Flat(args)
             if t is not None and not t.shape.is_fully_defined()]
  if unknown:
    # E.g. a time axis trimmed per batch: XLA would compile again for each
    # new length, and the timing has no shape to build.
    return ("an input's shape is not known when the graph is built (%s); "
            'XLA would compile again per shape' % unknown[0])
  return None


def Cached(params, args, do_eval: bool, num_devices: int):
  """The cache entry of a pipeline of `params` on inputs like `args`, or
  None."""
  key = Signature(params, args, do_eval, num_devices)
  return cache_files.Read(CachePath()).get(key)


def Describe(entry, how: str) -> str:
  """'auto''s choice in a cache entry, e.g. "took True: 1.0 ms per step
  with XLA, 2.0 without (cached in PATH)"."""
  if entry.get('xla_error'):
    return ('took False: XLA cannot compile the cells (%s); %.1f ms per step '
            'without (%s %s)' % (entry['xla_error'], entry['ms_tf'], how,
                                 CachePath()))
  return ('took %s: %.1f ms per step with XLA, %.1f without (%s %s)' % (
      entry['jit_compile'], entry['ms_xla'], entry['ms_tf'], how, CachePath()))


def AtBuild(layer, args) -> bool:
  """The layer's jit_compile as a bool when its FProp builds: None (unset)
  as False; 'auto' (left unresolved by the caller) as its cached choice,
  else False. Never measures."""
  p = layer.params
  value = Normalize(p.name, p.jit_compile)
  if value != 'auto':
    return bool(value)
  why = Unmeasurable(p, args)
  if why:
    tf.logging.info("%s: jit_compile='auto' took False: %s.", p.name, why)
    return False
  entry = Cached(p, args, layer.do_eval, layer.cluster.num_devices_per_split)
  if entry is not None:
    tf.logging.info("%s: jit_compile='auto' %s.", p.name,
                    Describe(entry, 'cached in'))
    return bool(entry['jit_compile'])
  tf.logging.log_first_n(
      tf.logging.WARNING,
      "%s: jit_compile='auto' has no cached choice for this build; built "
      "without XLA. 'auto' is resolved before the model is built: by "
      'lingvo_ext.trainer for its training model, or by '
      'lingvo_ext.runtime.jit_resolve.Resolve (experiment params) or '
      'ResolveLayer (a layer built directly); or set jit_compile True or '
      'False.', 1, p.name)
  return False


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
