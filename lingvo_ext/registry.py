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

`GetParams(model, dataset, overrides)` builds an experiment's params with
that search and applies --model_params_override with `ApplyOverrides`; the
trainer hands Lingvo's RunnerManager a `ModelRegistry` (its `model_registry`
extension point), so Lingvo's own lookup and override parsing are not used.
Importing `params/` also points Lingvo's `model_registry.GetParams` at
`ImportParams`, for code that calls Lingvo's registry directly.
"""

import ast
import difflib
import importlib
import os
import re
import sys

import lingvo_ext  # pylint: disable=unused-import,g-bad-import-order

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The package whose modules register the experiments: the repository's
# params/, which imports this module (to point Lingvo's lookup here). The
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


class OverrideError(ValueError):
  """A bad --model_params_override: its message is one line."""


_OVERRIDE_FLAG = '--model_params_override'


def _OverrideItems(text):
  """[(key, value text)] of an override text (';' or newline separated)."""
  items = []
  for line in text.replace(';', '\n').split('\n'):
    line = line.strip()
    if not line or line.startswith('#'):
      continue
    key, sep, value = line.partition(':')
    if not sep or not key.strip():
      raise OverrideError(
          f'{_OVERRIDE_FLAG}: {line!r} is not key:value; write e.g. '
          "--model_params_override='task.num_micro_batches:4'.")
    items.append((key.strip(), value.strip()))
  return items


def _Lookup(cfg, key):
  """(params holding key's last part, last part); errors name close keys."""
  from lingvo.core import hyperparams  # pylint: disable=g-import-not-at-top
  parts = key.split('.')
  node, path = cfg, []
  for i, part in enumerate(parts):
    if not isinstance(node, hyperparams.Params):
      where = '.'.join(path)
      raise OverrideError(
          f'{_OVERRIDE_FLAG}: unknown key {key!r}: {where} is '
          f'{type(node).__name__} ({node!r}), not params with keys.')
    if part not in node:
      names = sorted(name for name, _ in node.IterParams())
      prefix = '.'.join(path + [''])
      close = difflib.get_close_matches(part, names, n=3, cutoff=0.6)
      where = '.'.join(path) or 'the model params'
      hint = (' Did you mean ' + ', '.join(prefix + c for c in close) + '?'
              if close else f' Keys of {where}: {", ".join(names)}.')
      if i == len(parts) - 1:
        # A pipeline switch (task.schedule) where the pipeline is deeper.
        from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
        hint = pipeline_tree.OverrideHint(cfg, key) or hint
      raise OverrideError(f'{_OVERRIDE_FLAG}: unknown key {key!r}: {where} '
                          f'has no {part!r}.{hint}')
    if i == len(parts) - 1:
      return node, part
    path.append(part)
    node = node.Get(part)
  raise AssertionError(key)


_BOOLS = {'True': True, 'true': True, '1': True,
          'False': False, 'false': False, '0': False}
# Bool params that also take a word (PipeliningLayer.jit_compile: 'auto').
_BOOL_WORDS = {'jit_compile': ('auto',)}


def _Unquote(text):
  if len(text) >= 2 and text[0] == text[-1] and text[0] in '"\'':
    return re.sub(r"""\\([\\'"])""", r'\1', text[1:-1])
  return text


def _ParseValue(key, old, default, text):
  """The typed value of `text` for a param whose value is `old`."""
  def Bad(expected):
    return OverrideError(f'{_OVERRIDE_FLAG}: {key}:{text} is not valid: '
                         f'{key} takes {expected}.')

  if text in ('None', 'NoneType', 'none'):
    if old is None or default is None:
      return None
    kind = type(old).__name__
    raise Bad(f'{"an" if kind[0] in "aeiou" else "a"} {kind}, not None')
  if isinstance(old, bool):
    words = _BOOL_WORDS.get(key.rsplit('.', 1)[-1], ())
    if _Unquote(text) in words:
      return _Unquote(text)
    if text not in _BOOLS:
      raise Bad(' or '.join(['True', 'False'] + [repr(w) for w in words]))
    return _BOOLS[text]
  if isinstance(old, int):
    try:
      return int(text)
    except ValueError:
      raise Bad('an int') from None
  if isinstance(old, float):
    try:
      return float(text)
    except ValueError:
      raise Bad('a float') from None
  if isinstance(old, str):
    return _Unquote(text)
  if old is None:
    # Untyped (default None): True/False (any case Lingvo takes), a Python
    # literal (3, 0.5, (1, 2)...), else the text as a string.
    if text in ('True', 'true', 'False', 'false'):
      return _BOOLS[text]
    try:
      return ast.literal_eval(text)
    except (ValueError, SyntaxError):
      return _Unquote(text)
  if isinstance(old, (list, tuple, dict)):
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      raise Bad(f'a Python {type(old).__name__} literal, e.g. '
                f'{old!r}') from None
    if not isinstance(value, (list, tuple, dict)):
      raise Bad(f'a Python {type(old).__name__} literal, e.g. {old!r}')
    return value
  return None  # Any other type: Lingvo's FromText parses it.


def ApplyOverrides(cfg, text):
  """Applies --model_params_override `text` to `cfg`, checking every item.

  Unlike Lingvo's FromText: an unknown key names the close keys at the level
  where it went wrong; a value that does not parse as the param's type says
  the type; `None` is accepted for params whose default is None, and
  True/False for untyped ones (default None). `task.input.X` is `input.X`
  where the task has no input yet (TaskInputAlias).

  Raises:
    OverrideError: (a ValueError) with a one-line message.
  """
  from lingvo.core import hyperparams  # pylint: disable=g-import-not-at-top
  from lingvo_ext._internal import lingvo as internal_lingvo  # pylint: disable=g-import-not-at-top
  text = TaskInputAlias(text, cfg)
  for key, value_text in _OverrideItems(text):
    node, name = _Lookup(cfg, key)
    old = node.Get(name)
    default = internal_lingvo.ParamDefault(node, name)
    if isinstance(old, hyperparams.Params):
      raise OverrideError(
          f'{_OVERRIDE_FLAG}: {key} holds params; set one of its keys, e.g. '
          f'{key}.{next(iter(sorted(k for k, _ in old.IterParams())), "x")}'
          ':...')
    value = _ParseValue(key, old, default, value_text)
    if value is None and value_text not in ('None', 'NoneType', 'none'):
      try:  # Lingvo's own parsing (dtypes, enums, dataclasses...).
        cfg.FromText(f'{key}:{value_text}')
      except Exception as e:  # pylint: disable=broad-except
        first = str(e).strip().split('\n')[0]
        raise OverrideError(
            f'{_OVERRIDE_FLAG}: {key}:{value_text} is not valid for a '
            f'{type(old).__name__} param: {first}') from None
      continue
    node.Set(**{name: value})
  return cfg


def InstallImportParams():
  """Makes Lingvo's model_registry look experiments up with ImportParams.

  Lingvo's own lookup tries six modules under lingvo.tasks for each model
  name, printing `model_imports.py: Importing ...` for each, and does not
  find params/'s experiments; ImportParams imports the experiment's module
  (or params/) and prints nothing. Only for code that calls Lingvo's
  model_registry directly (importing `params` does this); lingvo_ext's
  trainer and tools use GetParams.
  """
  from lingvo_ext._internal import lingvo as internal_lingvo  # pylint: disable=g-import-not-at-top
  internal_lingvo.SetModelImporter(ImportParams)


def _FileOverride(path):
  """The text of a --model_params_file_override file ('' if none)."""
  if not path:
    return ''
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  if not tf.io.gfile.exists(path):
    return ''  # As Lingvo: a missing file is ignored.
  with tf.io.gfile.GFile(path) as f:
    return f.read()


_MODEL_OBJECTS = {}


def GetParams(model, dataset_name, overrides='', file_override='',
              gpipe_engine='lingvo_ext'):
  """The params of experiment `model` for `dataset_name`, overrides applied.

  Lingvo's model_registry.GetParams, with lingvo_ext's search (params/ and
  the module --model names) and checked overrides. With
  gpipe_engine='lingvo_ext' every Lingvo GPipe layer in the params runs on
  lingvo_ext's engine (`lingvo_ext.core.from_lingvo.FromLingvo`), before the
  overrides, so they can set its switches (`task.lm.stack.schedule`). A
  bucketed fixed-shape LmInput gets batches of the shape it states
  (`tasks.bucketed_input`).

  Args:
    model: A registered name, e.g. 'lm.TransformerLmTiny'.
    dataset_name: 'Train', 'Dev', 'Test'...
    overrides: A --model_params_override text, applied with ApplyOverrides.
    file_override: A --model_params_file_override path, applied with
      Lingvo's FromText when there is no `overrides`.
    gpipe_engine: --gpipe_engine: 'lingvo_ext' or 'lingvo' (the params as
      the experiment builds them).

  Raises:
    LookupError: `model` is not registered (the message names close ones).
    OverrideError: a bad override (a ValueError, one line).
  """
  from lingvo_ext._internal import lingvo as internal_lingvo  # pylint: disable=g-import-not-at-top
  error = CheckModel(model)
  if error:
    raise LookupError(error)
  if overrides and file_override:
    raise OverrideError('pass only one of --model_params_override and '
                        '--model_params_file_override.')
  if model not in _MODEL_OBJECTS:  # Lingvo caches them alike.
    _MODEL_OBJECTS[model] = _Registered()[model]()
  cfg = internal_lingvo.DatasetParams(_MODEL_OBJECTS[model], dataset_name)
  from lingvo_ext.core import from_lingvo  # pylint: disable=g-import-not-at-top
  cfg = from_lingvo.ApplyEngine(cfg, gpipe_engine)
  if overrides:
    ApplyOverrides(cfg, overrides)
  else:
    text = _FileOverride(file_override)
    if text:
      cfg.FromText(text)
  from lingvo_ext.tasks import bucketed_input  # pylint: disable=g-import-not-at-top
  bucketed_input.ApplyPadding(cfg)  # Batches of their stated shape.
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  if ('task' in cfg and 'fprop_dtype' in cfg.task and
      isinstance(cfg.task.fprop_dtype, str) and
      not pipeline_tree.IsPipelinedTask(cfg.task)):
    # An override gives the dtype as text; Lingvo's layers take a tf.DType
    # (a PipelinedTask parses it itself).
    from lingvo_ext.core import precision  # pylint: disable=g-import-not-at-top
    cfg.task.fprop_dtype = precision.ParseDtype(
        cfg.task.fprop_dtype, f'{cfg.task.name}: task.fprop_dtype')
  return cfg


class ModelRegistry:
  """What Lingvo's RunnerManager asks its `model_registry` for.

  RunnerManager.model_registry is Lingvo's extension point for another
  registry ("so these classes can be overridden"); the trainer sets one of
  these, made once from its flags, so every runner's params come from
  GetParams with the same overrides.
  """

  def __init__(self, overrides='', file_override='',
               gpipe_engine='lingvo_ext'):
    self._overrides = overrides
    self._file_override = file_override
    self._gpipe_engine = gpipe_engine

  def GetParams(self, class_key, dataset_name):
    return GetParams(class_key, dataset_name, self._overrides,
                     self._file_override, self._gpipe_engine)

  def GetClass(self, class_key):
    error = CheckModel(class_key)
    if error:
      raise LookupError(error)
    return _Registered()[class_key]
