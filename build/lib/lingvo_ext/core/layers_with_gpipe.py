"""Lingvo's GPipe Transformer stacks, on lingvo_ext's PipeliningLayer.

`lingvo.core.layers_with_gpipe` builds `GPipeTransformerStack`,
`GPipeEvolvedTransformerStack` and `GPipeBatchMajorTransformerStack` (and
their layers) on `lingvo.core.gpipe`. This module is the installed Lingvo
module itself, executed once more with `lingvo_ext.core.gpipe` standing in
for `lingvo.core.gpipe`, so its stacks are lingvo_ext `PipeliningLayer`s
(schedules, checks) with Lingvo's params, variable names and outputs.
Switch by changing the import::

    from lingvo_ext.core import layers_with_gpipe
    p = layers_with_gpipe.GPipeTransformerStack.Params().Set(...)

Its classes are distinct from `lingvo.core.layers_with_gpipe`'s (so an
`isinstance` against Lingvo's stack is False); everything else in the module
is Lingvo's.
"""

import importlib.util
import sys

from lingvo.core import gpipe as _lingvo_gpipe  # pylint: disable=unused-import
from lingvo_ext.core import gpipe as _ext_gpipe

_LINGVO_MODULE = 'lingvo.core.layers_with_gpipe'
_GPIPE_MODULE = 'lingvo.core.gpipe'


def _LoadOnLingvoExt():
  """Executes Lingvo's layers_with_gpipe source with lingvo_ext's gpipe."""
  spec = importlib.util.find_spec(_LINGVO_MODULE)
  module = importlib.util.module_from_spec(spec)
  saved = sys.modules[_GPIPE_MODULE]
  sys.modules[_GPIPE_MODULE] = _ext_gpipe
  try:
    spec.loader.exec_module(module)
  finally:
    sys.modules[_GPIPE_MODULE] = saved
  return module


_module = _LoadOnLingvoExt()
if _module.PipeliningLayer is not _ext_gpipe.PipeliningLayer:
  raise ImportError('%s did not take PipeliningLayer from %s.' %
                    (_LINGVO_MODULE, _GPIPE_MODULE))
for _name, _value in vars(_module).items():
  if not _name.startswith('__'):
    globals()[_name] = _value
# Classes report this module, so their params print where they come from.
for _value in list(globals().values()):
  if (isinstance(_value, type) and
      getattr(_value, '__module__', None) == _LINGVO_MODULE):
    _value.__module__ = __name__
del _name, _value
