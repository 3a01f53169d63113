"""XLA's compiled cells kept across processes: TensorFlow's persistent cache.

A pipeline cell built with XLA (`jit_compile`) is compiled when its first
step runs, in every process: about 4 CPU-seconds for lm.TransformerLmTiny's
cells, which a restart, a resumed run or each test of a suite pays again.
TensorFlow can keep compiled executables in a folder
(`--tf_xla_persistent_cache_directory` of TF_XLA_FLAGS), read when TensorFlow
is imported. `Install` (called by the programs, through
`lingvo_ext.entry_point`, before they import TensorFlow) points it at
`$XDG_CACHE_HOME/lingvo_ext/xla/<TF version>-<CPU key>` (default
~/.cache), beside jit_compile='auto''s choices: compiled code runs only on
the CPU it was compiled for, so each CPU model and instruction set has its
own folder. A TF_XLA_FLAGS that names a cache folder already is the user's
and is kept (an empty one turns the cache off). Pure Python: no TensorFlow
import. docs/performance.md, "XLA".
"""

import hashlib
import os
import sys
from typing import Optional

_FLAGS_VAR = 'TF_XLA_FLAGS'
_DIR_FLAG = '--tf_xla_persistent_cache_directory'


def CacheRoot() -> str:
  """lingvo_ext's folder under $XDG_CACHE_HOME (default ~/.cache)."""
  root = os.environ.get('XDG_CACHE_HOME') or os.path.join(
      os.path.expanduser('~'), '.cache')
  return os.path.join(root, 'lingvo_ext')


def CpuKey() -> str:
  """A short hash of the CPU's model name and instruction-set flags."""
  wanted = []
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        key = line.split(':', 1)[0].strip()
        if key in ('model name', 'flags') and key not in dict(wanted):
          wanted.append((key, line.split(':', 1)[-1].strip()))
  except OSError:
    pass
  text = repr(wanted) + os.uname().machine
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def _TensorFlowVersion() -> str:
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    return metadata.version('tensorflow')
  except Exception:  # pylint: disable=broad-except
    return 'unknown'


def CacheDir() -> str:
  """The folder of this CPU's and TensorFlow's compiled executables."""
  return os.path.join(CacheRoot(), 'xla',
                      f'tf{_TensorFlowVersion()}-{CpuKey()}')


# Whether the cells' tf.functions are named by their order in their graph
# (`UseStableNames`; _internal/tf.py's StableFunctionName).
_stable_names = False


def UseStableNames():
  """Names the cells' functions stably in this process, so that XLA's cache
  finds them in the next one (the programs call it; a library user's
  process keeps TensorFlow's names)."""
  global _stable_names
  _stable_names = True


def StableNames() -> bool:
  """Whether `UseStableNames` was called in this process."""
  return _stable_names


def Install() -> Optional[str]:
  """Sets TF_XLA_FLAGS' cache folder (CacheDir) for this process and the
  processes it starts; the folder, or None where it left things as they
  were (the user's folder, TensorFlow already imported, no writable
  folder)."""
  flags = os.environ.get(_FLAGS_VAR, '')
  if _DIR_FLAG in flags or 'tensorflow' in sys.modules:
    return None
  path = CacheDir()
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None
  if not os.access(path, os.W_OK):
    return None
  os.environ[_FLAGS_VAR] = f'{flags} {_DIR_FLAG}={path}'.strip()
  return path
