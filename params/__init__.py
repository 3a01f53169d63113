"""Registered lingvo_ext experiments.

Importing this package imports every module in it (files starting with '_'
excepted), so a new `params/mine.py` registers its classes without
editing anything else. Each class is keyed by its module path less this
package's: `params/lm.py`'s classes are lm.<Class>, `mine.py`'s
mine.<Class>.
Importing it also points Lingvo's model lookup at lingvo_ext.registry.
"""

import importlib
import pkgutil

from lingvo_ext import registry as _registry
from lingvo_ext._internal import lingvo as _internal_lingvo

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
  if not _info.name.startswith('_'):
    importlib.import_module(f'{__name__}.{_info.name}')
_internal_lingvo.RekeyRegisteredModels(__name__)

# model_registry.GetParams finds these experiments without Lingvo's search of
# lingvo.tasks (and its 'model_imports.py: Importing ...' lines).
_registry.InstallImportParams()
