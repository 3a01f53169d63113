"""Registered lingvo_ext experiments.

Importing this package imports every module in it (files starting with '_'
excepted), so a new `params/mine.py` registers its classes without editing
anything else. Lingvo keys a class by its module path less 'params.':
`params/lm.py`'s classes are lm.<Class>, `params/mine.py`'s mine.<Class>.
Importing it also points Lingvo's model lookup at lingvo_ext.registry.
"""

import importlib
import pkgutil

from lingvo_ext import registry as _registry

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
  if not _info.name.startswith('_'):
    importlib.import_module(f'{__name__}.{_info.name}')

# model_registry.GetParams finds these experiments without Lingvo's search of
# lingvo.tasks (and its 'model_imports.py: Importing ...' lines).
_registry.InstallImportParams()
