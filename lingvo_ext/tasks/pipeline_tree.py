"""The pipelines an experiment's params hold, wherever they are.

lingvo_ext's `PipelinedTask` keeps its pipeline switches on the task
(`task.schedule`); any other experiment (Lingvo's own task code, a user's
task) holds its `PipeliningLayer`s somewhere in its Params tree, e.g.
`task.lm.stack` for `lingvo.tasks.lm.layers.GPipeTransformerLm`. This module
finds them, so the trainer, the override hints and the planner treat every
experiment alike:

- `Pipelines(cfg)`: [(override path, params)] of each PipeliningLayer;
- `OverrideHint(cfg, key)`: "did you mean `task.lm.stack.schedule`" for a
  key naming a pipeline switch at the wrong place;
- `CheckPipelines(cfg, ...)`: the checks the layers make when built (the
  schedule, recompute, dtype, the batch against num_micro_batches), before
  anything is written.
"""

from lingvo.core import hyperparams

from lingvo_ext.core import jit_choice
from lingvo_ext.core import precision
from lingvo_ext.pipeline import records
from lingvo_ext.pipeline import schedules
from lingvo_ext.tasks import bucketed_input
from lingvo_ext.tasks import pipelined_task


def _IsPipeline(value):
  # pylint: disable=g-import-not-at-top
  from lingvo.core import gpipe as lingvo_gpipe

  from lingvo_ext.core import gpipe
  # pylint: enable=g-import-not-at-top
  return (isinstance(value, hyperparams.InstantiableParams) and
          isinstance(value.cls, type) and
          issubclass(value.cls,
                     (gpipe.PipeliningLayer, lingvo_gpipe.PipeliningLayer)))


def _Walk(value, path, found):
  if _IsPipeline(value):
    found.append((path, value))
    return  # A pipeline's cells hold no pipeline of their own.
  if isinstance(value, hyperparams.Params):
    for name, sub in value.IterParams():
      _Walk(sub, f'{path}.{name}' if path else name, found)
  elif isinstance(value, dict):
    for k, v in value.items():
      _Walk(v, f'{path}[{k!r}]', found)
  elif isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      _Walk(v, f'{path}[{i}]', found)


def Pipelines(cfg):
  """[(path, params)] of each PipeliningLayer (lingvo_ext's or Lingvo's).

  Args:
    cfg: Params (an experiment's model params, a task's...).

  Returns:
    In tree order; the path is the --model_params_override key of the
    layer's params, e.g. 'task.lm.stack' (list items as `sub[2]`).
  """
  found = []
  _Walk(cfg, '', found)
  return found


def IsPipelinedTask(task_params):
  """Whether task params are lingvo_ext's PipelinedTask's."""
  return (isinstance(getattr(task_params, 'cls', None), type) and
          issubclass(task_params.cls, pipelined_task.PipelinedTask))


def OverrideHint(cfg, key):
  """' Did you mean `X`?' where `key`'s last part is a pipeline's param.

  Args:
    cfg: The params the override is applied to.
    key: The unknown override key, e.g. 'task.schedule'.

  Returns:
    The hint text (starting with a space), or '' if no pipeline has the key.
  """
  name = key.split('.')[-1]
  paths = [f'{path}.{name}' for path, p in Pipelines(cfg)
           if name in p and f'{path}.{name}' != key]
  if not paths:
    return ''
  return ' Did you mean ' + ' or '.join(f'`{x}`' for x in paths) + '?'


def _BatchSizes(input_params):
  """The input's per-replica batch sizes (one per bucket), or []."""
  if input_params is None:
    return []
  if bucketed_input.NeedsPadding(input_params):
    # Every bucket's batch padded to the largest (bucketed_input).
    return [max(input_params.bucket_batch_limit)]
  sizes = []
  if 'bucket_batch_limit' in input_params and input_params.bucket_batch_limit:
    sizes = list(input_params.bucket_batch_limit)
  elif 'batch_size' in input_params and input_params.batch_size:
    sizes = [input_params.batch_size]
  return [b for b in sizes if isinstance(b, int)]


def CheckTimeMajorLm(task):
  """Raises for Lingvo's time-major LanguageModel feeding GPipeTransformerLm.

  LanguageModel gives its `lm` ids [time, batch]; GPipeTransformerLm takes
  [batch, time] and pipelines over the batch, so no engine can train the
  pair (off TPU the trimmed time axis is even unknown).
  """
  if (task is None or 'lm' not in task or
      not isinstance(task.lm, hyperparams.InstantiableParams) or
      not task.cls.__module__.startswith('lingvo.tasks.lm')):
    return
  # pylint: disable=g-import-not-at-top
  from lingvo.tasks.lm import layers as lm_layers
  from lingvo.tasks.lm import model as lm_model
  # pylint: enable=g-import-not-at-top
  if (issubclass(task.cls, lm_model.LanguageModel) and
      not issubclass(task.cls, lm_model.BatchMajorLanguageModel) and
      issubclass(task.lm.cls, lm_layers.GPipeTransformerLm)):
    raise ValueError(
        f'task {task.name} ({task.cls.__name__}) feeds task.lm '
        f'({task.lm.cls.__name__}) time-major ids [time, batch], but it '
        'takes [batch, time] and pipelines over the batch; build the task '
        'with lingvo.tasks.lm.model.BatchMajorLanguageModel.Params().')


def CheckPipelines(cfg, num_replicas=1):
  """Raises ValueError for what a pipeline in `cfg` would refuse when built.

  Args:
    cfg: An experiment's model params (with `input` and `task`).
    num_replicas: Data-parallel replicas the trainer runs (for messages).

  Returns:
    The [(path, params)] of the pipelines checked.
  """
  pipelines = Pipelines(cfg)
  task = cfg.task if 'task' in cfg else None
  if task is not None and 'fprop_dtype' in task:
    precision.ParseDtype(task.fprop_dtype, f'{task.name}: task.fprop_dtype')
  if pipelines:
    CheckTimeMajorLm(task)
  input_params = cfg.input if 'input' in cfg else None
  batches = _BatchSizes(input_params)
  for path, p in pipelines:
    where = f'{path} ({p.cls.__name__})'
    key = 'input.fixed_input_shape'
    if (input_params is not None and 'fixed_input_shape' in input_params and
        not input_params.fixed_input_shape):
      raise ValueError(
          f'{where} splits the batch into micro-batches statically, but '
          f'{key}=False gives batches of unknown shape; set it: '
          f"--model_params_override='{key}:True'.")
    if 'schedule' in p:
      records.CheckName(p.schedule, where, override=f'{path}.schedule')
    if 'jit_compile' in p:
      jit_choice.CheckValue(f'{where}', p.jit_compile)
    if 'recompute' in p:
      if p.recompute not in (None, True, False):
        raise ValueError(f'{where}: recompute={p.recompute!r}; use None, '
                         'True or False.')
      if (p.recompute is False and
          p.schedule in schedules.ALWAYS_RECOMPUTE):
        raise ValueError(
            f'{where}: recompute=False, but schedule={p.schedule!r} always '
            f'recomputes; set {path}.recompute to None or True.')
    m = p.num_micro_batches
    if not isinstance(m, int) or m < 1:
      raise ValueError(f'{where}: num_micro_batches={m!r} must be an int '
                       '>= 1.')
    for batch in batches:
      if p.micro_batch_size and p.micro_batch_size * m != batch:
        raise ValueError(
            f'{where}: micro_batch_size={p.micro_batch_size} x '
            f'num_micro_batches={m} != the input batch {batch}; set '
            f'{path}.micro_batch_size to None or {batch // m or 1}.')
      if batch % m:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(
            f'{where}: the input batch {batch} (per replica, of '
            f'{num_replicas}) is not divisible by num_micro_batches={m}; '
            f'set {path}.num_micro_batches to one of {divisors} or change '
            'the input batch size.')
  return pipelines


def PlannerRefusal(cfg, model):
  """Why the planner cannot plan `cfg`, in one line; None if it can.

  The planner cuts a PipelinedTask's flat `LayerStack` into cells; any other
  experiment's pipelines it plans with their cells as cut
  (lingvo_ext.planner.tree). An experiment with neither is refused.
  """
  task = cfg.task if 'task' in cfg else None
  if task is not None and hasattr(task.cls, 'LayerStack'):
    return None
  if Pipelines(cfg):
    return None
  name = task.cls.__name__ if task is not None else type(cfg).__name__
  return (f'--model={model}: its task {name} holds no pipeline '
          '(PipeliningLayer); the planner plans pipelined experiments.')


def IsCut(cfg):
  """Whether the planner plans `cfg`'s pipelines as cut (not a LayerStack)."""
  task = cfg.task if 'task' in cfg else None
  return not (task is not None and hasattr(task.cls, 'LayerStack')) and bool(
      Pipelines(cfg))


def TrimsTimeAxis(task):
  """Whether task params give their pipelines a time axis known at run time
  only: Lingvo's BatchMajorLanguageModel trims it to each batch's longest
  sentence (off TPU, without packed_input), unless a subclass replaces
  that trim."""
  if task is None or not isinstance(getattr(task, 'cls', None), type):
    return False
  from lingvo.tasks.lm import model as lm_model  # pylint: disable=g-import-not-at-top

  from lingvo_ext._internal import lingvo as internal_lingvo  # pylint: disable=g-import-not-at-top
  return (issubclass(task.cls, lm_model.BatchMajorLanguageModel) and
          not internal_lingvo.OverridesTimeAxisTrim(task.cls) and
          not ('packed_input' in task and task.packed_input))


def NumCells(p):
  """The cells pipeline params `p` builds: `splits` of Lingvo's stacks, else
  its `cell_tpl`; None if unknown."""
  if 'splits' in p and p.splits is not None:
    return p.splits if isinstance(p.splits, int) else len(p.splits)
  if 'cell_tpl' in p and p.cell_tpl:
    return len(p.cell_tpl)
  return None


def _NumLayers(p):
  return p.num_encoder_layers + (p.num_decoder_layers
                                 if 'num_decoder_layers' in p else 0)


def EmptyCells(p):
  """The cells (by index) of a Lingvo Transformer stack's params that its
  `splits` leave without a layer (Lingvo's cut, splits beyond the layers)."""
  if not ('splits' in p and 'num_encoder_layers' in p and
          isinstance(p.splits, int) and p.splits > 0):
    return []
  layers = _NumLayers(p)
  per_cell = (layers - 1) // p.splits + 1
  ends = [(i + 1) * per_cell for i in range(p.splits)]
  ends[-1] = layers
  start, empty = 0, []
  for i, end in enumerate(ends):
    # Lingvo's cell i holds its layers [start, end + 1) (the embedding is
    # layer 0); the last also holds the softmax.
    if min(end + 1, layers + 1) <= start and i < len(ends) - 1:
      empty.append(i)
    start = end + 1
  return empty


def ScheduleRefusal(cfg, num_devices, gpipe_engine='lingvo_ext'):
  """The one-line refusal of a pipeline's schedule in `cfg`, or None.

  `records.Refusal` for every pipeline (a PipelinedTask's, or each
  PipeliningLayer in the params; Lingvo's engine as its loop), and the cells
  a Lingvo stack's `splits` would leave empty.

  Args:
    cfg: An experiment's model params.
    num_devices: The devices of a model split (--worker_split_size).
    gpipe_engine: --gpipe_engine.
  """
  task = cfg.task if 'task' in cfg else None
  static = not TrimsTimeAxis(task)
  found = []
  if task is not None and IsPipelinedTask(task):
    found.append(('task', task.schedule, task.num_partitions,
                  task.num_micro_batches))
  for path, p in Pipelines(cfg):
    k = NumCells(p)
    empty = EmptyCells(p)
    if empty:
      return (f'{path}: splits={p.splits} leaves cells '
              f'{", ".join(f"cell_{i}" for i in empty)} without a layer '
              f'(the stack has fewer layers than cells); set {path}.splits '
              f'to at most {_NumLayers(p)}.')
    if k is None or not isinstance(p.num_micro_batches, int):
      continue
    schedule = (records.LINGVO_ENGINE if gpipe_engine == 'lingvo' else
                p.schedule if 'schedule' in p else 'unrolled')
    found.append((path, schedule, k, p.num_micro_batches))
  for path, schedule, k, m in found:
    if schedule not in records.BY_NAME:
      continue  # CheckPipelines / CheckParams name the choices.
    error = records.Refusal(schedule, k, num_devices, m, static)
    if not error:
      continue
    why = ''
    if error != records.Refusal(schedule, k, num_devices, m):
      why = (f'task {task.name} ({task.cls.__name__}) trims the time axis '
             'to each batch; ')
    if gpipe_engine == 'lingvo':
      return (f"--gpipe_engine=lingvo runs Lingvo's own loop on {path}: "
              f'{why}{error}, with --gpipe_engine=lingvo_ext (the default; '
              f"--model_params_override='{path}.schedule:\"1f1b\"').")
    return f'{path}: {why}{error}.'
  return None
