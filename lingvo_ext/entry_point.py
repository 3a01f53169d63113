"""Imported first by each program of lingvo_ext: a quiet console.

`from lingvo_ext import entry_point` at the top of a program's module (the
trainer, the launcher, the fork server, the tools) filters TensorFlow's
start-up lines and shows Lingvo's repeated warnings once
(`lingvo_ext/_startup.py`), before the module's other imports load
TensorFlow. `import lingvo_ext` alone leaves the process's stderr, logging
and TF_CPP_MIN_LOG_LEVEL as they were: a library does not change its
user's console. Nothing is filtered where the user set TF_CPP_MIN_LOG_LEVEL.
It also keeps XLA's compiled cells across the programs' processes
(`lingvo_ext/xla_cache.py`, which TensorFlow reads at its import; the cells'
functions named stably), and defers the optional modules TensorFlow's and
Lingvo's imports load but a run never uses (`_internal/deferred.py`).
`ParseFlags` is the one place a program that builds a model parses absl's
flags, which Lingvo's layers read.
"""

from lingvo_ext import _startup
from lingvo_ext import xla_cache
from lingvo_ext._internal import deferred

_startup.Install()
deferred.Install()
xla_cache.Install()
xla_cache.UseStableNames()


def ParseFlags(argv=(), program=None):
  """Parses absl's flags once, for a program that builds a model.

  Lingvo's layers read absl flags while they build (`--tflite_compatible`
  in causal self-attention, ...), which raises until the flags are parsed:
  every program that builds a model (the trainer, the tools, export) calls
  this first. `argv`: the flags for absl (the program's own taken
  out); `program`: argv[0] (default sys.argv[0]). Returns None, or the
  error (the flag and why).
  """
  import sys  # pylint: disable=g-import-not-at-top

  from absl import flags  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils_flags  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  argv = list(argv)
  if flags.FLAGS.is_parsed() and not argv:
    return None
  try:
    flags.FLAGS([program or (sys.argv[0] if sys.argv else 'lingvo_ext')] +
                argv)
  except flags.Error as e:
    return str(e)
  return None
