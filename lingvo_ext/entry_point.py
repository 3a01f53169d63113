"""Imported first by each program of lingvo_ext: a quiet console.

`from lingvo_ext import entry_point` at the top of a program's module (the
trainer, the launcher, the fork server, the tools) filters TensorFlow's
start-up lines and shows Lingvo's repeated warnings once
(`lingvo_ext/_startup.py`), before the module's other imports load
TensorFlow. `import lingvo_ext` alone leaves the process's stderr, logging
and TF_CPP_MIN_LOG_LEVEL as they were: a library does not change its
user's console. Nothing is filtered where the user set TF_CPP_MIN_LOG_LEVEL.
It also keeps XLA's compiled cells across the programs' processes
(`lingvo_ext/xla_cache.py`), which TensorFlow reads at its import.
"""

from lingvo_ext import _startup
from lingvo_ext import xla_cache

_startup.Install()
xla_cache.Install()
