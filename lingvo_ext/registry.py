"""The experiment registry: finds a registered experiment by its name.

Experiments are Lingvo param classes registered with
`@model_registry.RegisterSingleTaskModel`; Lingvo keys each by its module path
(less the experiments package's prefix) and class name. Two places are
searched:

- every module in the package `params/`
  (`params/mine.py` registers `mine.<Class>`), found by listing the
  package: nothing else needs editing;
- a module named by --model itself, imported from `sys.path` (PYTHONPATH):
  `--model=myexp.MyModel` imports `myexp`, `--model=a.b.MyModel` imports
  `a.b`.

It looks experiments up and nothing more: `tasks.experiment_params` builds
an experiment's params (the Lingvo rewrite, checked overrides, the dtype).
Importing `params` also points Lingvo's
`model_registry.GetParams` at `ImportParams`, for code that calls Lingvo's
registry directly.
"""

import difflib
import importlib
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The package whose modules register the experiments: the repository's
# params/, which imports this module (to point Lingvo's
# lookup here). The
# registry takes it by name, as its callers set it (`SetExperimentsPackage`),
# so that it does not import the package that imports it.
_EXPERIMENTS = {'package': 'params'}


def SetExperimentsPackage(package: str):
  """Registers experiments from `package` (a module path on sys.path)."""
  _EXPERIMENTS['package'] = package


def _ImportRepoParams():
  if _ROOT not in sys.path:
    sys.path.append(_ROOT)
  importlib.import_module(_EXPERIMENTS['package'])


def _Registered():
  from lingvo_ext._internal import lingvo as internal_lingvo  # pylint: disable=g-import-not-at-top
  return internal_lingvo.RegisteredModelClasses()


def ImportModule(module):
  """Imports a user's experiment module from sys.path; returns an error.

  Returns:
    None if `module` was imported or does not exist; the error message if it
    exists but failed to import.
  """
  if not module:
    return None
  _ImportRepoParams()
  try:
    importlib.import_module(module)
  except ModuleNotFoundError as e:
    if e.name and module.startswith(e.name):
      return None  # No such module: the name is simply unknown.
    return f'importing {module!r} failed: {e}'
  except Exception as e:  # pylint: disable=broad-except
    return f'importing {module!r} failed: {type(e).__name__}: {e}'
  return None


def ImportExperiments(model=None):
  """Registers the bundled experiments, and `model`'s module if it names one.

  Args:
    model: A --model value; when it is not registered by experiments/, its
      module
      (everything before the last '.') is imported from sys.path.

  Returns:
    An error message if `model`'s module exists but failed to import, else
    None.
  """
  _ImportRepoParams()
  if model and model not in _Registered():
    return ImportModule(model.rpartition('.')[0])
  return None


def RegisteredModels(model=None):
  """Sorted names of the registered experiments (see ImportExperiments)."""
  ImportExperiments(model)
  return sorted(_Registered())


def UnknownModelMessage(name):
  """The error for an unregistered --model, naming the close names."""
  import_error = ImportExperiments(name)
  if import_error:
    return f'--model={name}: {import_error}'
  names = RegisteredModels()
  close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
  # Also match on the class name alone (e.g. --model=TransformerLmTiny).
  close += [n for n in names if n.split('.')[-1].lower() == name.lower() and
            n not in close]
  msg = f'Unknown model {name!r}: it is not registered.'
  if close:
    msg += ' Did you mean:\n' + ''.join(f'  {n}\n' for n in close)
  else:
    msg += ' Registered models:\n' + ''.join(f'  {n}\n' for n in names)
  msg += ('List them with: .venv/bin/python -m lingvo_ext.tools.list_models. '
          'Your own experiment: put it in params/ or pass '
          '--model=module.Class '
          'with module on PYTHONPATH (README, "Your own experiment").')
  return msg


def CheckModel(model):
  """Returns None if `model` is registered (after importing), else an error."""
  if model in RegisteredModels(model):
    return None
  return UnknownModelMessage(model)


def ImportParams(model_name, *unused_args, **unused_kwargs):
  """model_imports.ImportParams for lingvo_ext: see the module docstring."""
  error = ImportExperiments(model_name)
  if error:
    raise LookupError(error)
  return model_name in _Registered()

_EXPERIMENTS_MADE = {}


def ExperimentClass(model):
  """The class registered as `model`.

  Raises:
    LookupError: `model` is not registered (the message names close ones).
  """
  error = CheckModel(model)
  if error:
    raise LookupError(error)
  return _Registered()[model]


def Experiment(model):
  """The registered experiment `model`, made once (Lingvo caches them alike).

  Raises:
    LookupError: `model` is not registered (the message names close ones).
  """
  cls = ExperimentClass(model)
  if model not in _EXPERIMENTS_MADE:
    _EXPERIMENTS_MADE[model] = cls()
  return _EXPERIMENTS_MADE[model]


def InstallImportParams():
  """Makes Lingvo's model_registry look experiments up with ImportParams.

  Lingvo's own lookup tries six modules under lingvo.tasks for each model
  name, printing `model_imports.py: Importing ...` for each, and does not
  find params/'s; ImportParams imports the experiment's
  module (or experiments/) and prints nothing. Only for code that calls
  Lingvo's model_registry directly (importing `params`
  does); lingvo_ext's trainer and tools use GetParams.
  """
  from lingvo_ext._internal import lingvo as internal_lingvo  # pylint: disable=g-import-not-at-top
  internal_lingvo.SetModelImporter(ImportParams)
