"""Optional modules that importing TensorFlow and Lingvo load but a run never uses.

Importing TensorFlow imports Keras eagerly, and Keras imports its
scikit-learn wrappers (`keras.wrappers`), which import scikit-learn and with
it `scipy.stats`, only because scikit-learn is installed; Lingvo's
`core.metrics` imports `sklearn.metrics` and `scipy.stats` for its AUC and
correlation metrics. lingvo_ext needs scikit-learn only for the digits data.

`Install` (called by the programs, through `lingvo_ext.entry_point`,
before TensorFlow is imported) puts a `Deferred` module in `sys.modules` for each of `DEFERRED`:
`import x` and `from x import y` of a module name find it there and bind it
without running the module; the first look at any of its attributes imports
the real module, and the placeholder then serves the real module's
attributes. Nothing changes for code that uses them, only when they load.
"""

import importlib
import importlib.machinery
import sys
import threading
import types
import weakref

# Deferred: Keras's scikit-learn wrappers; what Lingvo's metrics import.
DEFERRED = ('keras.wrappers', 'sklearn', 'sklearn.metrics', 'scipy.stats')
# A module is deferred only while none of these has run yet (they are the
# importers above, or load the module anyway).
_TOO_LATE = ('keras', 'lingvo.core.metrics')

_LOCK = threading.RLock()
# The placeholders that hold their real module's attributes.
_FILLED = weakref.WeakSet()


class Deferred(types.ModuleType):
  """A module name bound now; the module itself imported on first use."""

  def __init__(self, spec):
    super().__init__(spec.name)
    # Metadata is read without loading (importlib's checks, tools that list
    # sys.modules); not `__path__`: a submodule's import loads its package.
    self.__spec__ = spec
    self.__loader__ = spec.loader
    self.__file__ = spec.origin
    self.__package__ = spec.parent

  def __getattr__(self, name):
    return getattr(Load(self), name)

  def __repr__(self):
    return f'<deferred module {self.__name__!r}>'


def Load(module):
  """The real module of a `Deferred` one (imported now if not yet)."""
  name = object.__getattribute__(module, '__name__')
  with _LOCK:
    if sys.modules.get(name) is module:
      del sys.modules[name]
    real = importlib.import_module(name)
    if module not in _FILLED:
      # Later lookups are plain attribute reads; a name the real module
      # gains afterwards still reaches it through __getattr__.
      _FILLED.add(module)
      module.__dict__.update(real.__dict__)
  return real


def _Spec(name):
  """The spec of module `name`, found without importing its packages."""
  spec, path = None, None
  parts = name.split('.')
  for i in range(len(parts)):
    spec = importlib.machinery.PathFinder.find_spec('.'.join(parts[:i + 1]),
                                                   path)
    if spec is None:
      return None
    path = spec.submodule_search_locations
  return spec


def Install():
  """Defers each of DEFERRED that is installed and not imported yet."""
  if any(m in sys.modules for m in _TOO_LATE):
    return []
  out = []
  with _LOCK:
    for name in DEFERRED:
      if name in sys.modules:
        continue
      spec = _Spec(name)
      if spec is None or spec.loader is None:
        continue
      module = Deferred(spec)
      sys.modules[name] = module
      out.append(name)
      parent = name.rpartition('.')[0]
      if parent and isinstance(sys.modules.get(parent), Deferred):
        # As importlib binds a submodule in its package.
        setattr(sys.modules[parent], name.rpartition('.')[2], module)
  return out
