"""An experiment's params as lingvo_ext builds them, overrides checked.

`GetParams(model, dataset, overrides)` takes the experiment from the registry
(`lingvo_ext.registry`), runs every Lingvo GPipe layer in its params on
lingvo_ext's engine (`core.from_lingvo`), applies --model_params_override
with `ApplyOverrides` (each item checked: an unknown key names the close
ones, a value parses as its param's type), gives a bucketed input batches of
its stated shape and parses a text `fprop_dtype` (`core.precision`). The
trainer hands Lingvo's RunnerManager a `ModelRegistry` (its `model_registry`
extension point), so Lingvo's own lookup and override parsing are not used.
"""

import ast
import difflib
import re

from lingvo_ext import registry


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
# Bool params that also take a word (PipeliningLayer.jit_compile: 'auto'),
# typed so even where unset (None).
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
  words = _BOOL_WORDS.get(key.rsplit('.', 1)[-1])
  if isinstance(old, bool) or (old is None and words):
    words = words or ()
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


def _FileOverride(path):
  """The text of a --model_params_file_override file ('' if none)."""
  if not path:
    return ''
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  if not tf.io.gfile.exists(path):
    return ''  # As Lingvo: a missing file is ignored.
  with tf.io.gfile.GFile(path) as f:
    return f.read()


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
  experiment = registry.Experiment(model)
  if overrides and file_override:
    raise OverrideError('pass only one of --model_params_override and '
                        '--model_params_file_override.')
  cfg = internal_lingvo.DatasetParams(experiment, dataset_name)
  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core import from_lingvo
  from lingvo_ext.core import precision
  from lingvo_ext.tasks import bucketed_input
  from lingvo_ext.tasks import pipeline_tree
  # pylint: enable=g-import-not-at-top
  cfg = from_lingvo.ApplyEngine(cfg, gpipe_engine)
  if overrides:
    ApplyOverrides(cfg, overrides)
  else:
    text = _FileOverride(file_override)
    if text:
      cfg.FromText(text)
  bucketed_input.ApplyPadding(cfg)  # Batches of their stated shape.
  if ('task' in cfg and 'fprop_dtype' in cfg.task and
      isinstance(cfg.task.fprop_dtype, str) and
      not pipeline_tree.IsPipelinedTask(cfg.task)):
    # An override gives the dtype as text; Lingvo's layers take a tf.DType
    # (a PipelinedTask parses it itself).
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
    return registry.ExperimentClass(class_key)
