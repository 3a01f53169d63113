"""The experiment registry that the trainer, cost_report and list_models share.

Experiments are Lingvo param classes registered with
`@model_registry.RegisterSingleTaskModel`; Lingvo keys each by its module path
(less a `params.` prefix) and class name. Two places are searched:

- every module in the repository's `params/` package (`params/mine.py`
  registers `mine.<Class>`), found by listing the package: nothing else needs
  editing;
- a module named by --model itself, imported from `sys.path` (PYTHONPATH):
  `--model=myexp.MyModel` imports `myexp`, `--model=a.b.MyModel` imports
  `a.b`.

`Install()` makes Lingvo's `model_registry.GetParams` (which calls
`model_imports.ImportParams`) use the same search, instead of Lingvo's, which
only looks under `lingvo.tasks`.
"""

import difflib
import importlib
import os
import sys

import lingvo_ext  # pylint: disable=unused-import,g-bad-import-order

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ImportRepoParams():
  if _ROOT not in sys.path:
    sys.path.append(_ROOT)
  import params  # pylint: disable=g-import-not-at-top,unused-import


def _Registered():
  from lingvo import model_registry  # pylint: disable=g-import-not-at-top
  # The helper's map, not model_registry.GetAllRegisteredClasses(): that one
  # first tries to import all of lingvo.tasks' params, printing a line each.
  return model_registry._ModelRegistryHelper._MODEL_PARAMS  # pylint: disable=protected-access


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
  """Registers params/'s experiments, and `model`'s module if it names one.

  Args:
    model: A --model value; when it is not registered by params/, its module
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
          'Your own experiment: put it in params/ or pass --model=module.Class '
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


def TaskInputAlias(text, cfg):
  """Rewrites `task.input.X` overrides to `input.X` where the task has none.

  A single-task model's params hold the input at `input`; the task gets its
  copy (`task.input`) only when the model is built, after the overrides are
  applied. Both spellings then set the same param.
  """
  if ('task' not in cfg or 'input' not in cfg or cfg.input is None or
      getattr(cfg.task, 'input', None) is not None):
    return text
  lines = []
  for line in text.replace(';', '\n').split('\n'):
    stripped = line.lstrip()
    if stripped.startswith('task.input.'):
      line = stripped[len('task.'):]
    lines.append(line)
  return '\n'.join(lines)


def Install():
  """Makes Lingvo's model registry use lingvo_ext's.

  Points model_imports.ImportParams at ImportParams, and lets
  --model_params_override say `task.input.X` for `input.X` (TaskInputAlias).
  """
  from lingvo import model_imports  # pylint: disable=g-import-not-at-top
  from lingvo import model_registry  # pylint: disable=g-import-not-at-top
  model_imports.ImportParams = ImportParams
  helper = model_registry._ModelRegistryHelper  # pylint: disable=protected-access
  if not getattr(helper, '_lingvo_ext_installed', False):
    original = helper.MaybeUpdateParamsFromFlags.__func__
    flags = model_registry.FLAGS

    def MaybeUpdateParamsFromFlags(cls, cfg):
      text = flags.model_params_override
      if text:
        flags.model_params_override = TaskInputAlias(text, cfg)
      try:
        original(cls, cfg)
      finally:
        flags.model_params_override = text

    helper.MaybeUpdateParamsFromFlags = classmethod(MaybeUpdateParamsFromFlags)
    helper._lingvo_ext_installed = True  # pylint: disable=protected-access
  ImportExperiments()
