"""Plans for the pipelines of any experiment (Lingvo's task code, a user's).

A `PipelinedTask` hands the planner a flat `LayerStack` to cut; any other
experiment holds its `PipeliningLayer`s somewhere in its Params tree
(`tasks/pipeline_tree.py`), e.g. `task.lm.stack` of Lingvo's
`GPipeTransformerLm`, already cut into cells whose names are in its
variables and checkpoints. For each of them the planner keeps the cells as
the experiment cuts them and chooses the rest: the devices, micro-batches,
schedule and recompute. `ProfileTree` profiles each pipeline's cells in the
task as it is built (TF); `ChooseTree` predicts and ranks their plans, one
replica, on the same devices for all of them; `TreeOverrides` and
`ApplyTree` give the chosen plans' `--model_params_override` keys, e.g.
`task.lm.stack.schedule`. docs/coming-from-lingvo.md, "The planner".
Only `ProfileTree` imports TensorFlow (when called).
"""

import contextlib
import dataclasses
import io
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo_ext.pipeline import records
from lingvo_ext.planner import application
from lingvo_ext.planner import tf_profiling
from lingvo_ext.planner.choice import Rank
from lingvo_ext.planner.model_profile import LayerProfile
from lingvo_ext.planner.model_profile import Machine
from lingvo_ext.planner.model_profile import ModelProfile
from lingvo_ext.planner.plans import Candidate
from lingvo_ext.planner.plans import Enumerate
from lingvo_ext.planner.plans import PlanError
from lingvo_ext.planner.prediction import PredictAll


@dataclasses.dataclass(frozen=True)
class TreePipeline:
  """One pipeline of the tree as the planner sees it.

  Attributes:
    path: Its override path, e.g. 'task.lm.stack'.
    cls_name: Its layer class's name.
    profile: Its cells, one LayerProfile each.
    micro_batch_size: Its params' micro_batch_size (a plan resets it).
  """
  path: str
  cls_name: str
  profile: ModelProfile
  micro_batch_size: Optional[int] = None
  length: Optional['SequenceLength'] = None


# Train batches read to size a time axis the task trims at run time: a few,
# as their longest sequences vary little; each read is bounded (a broken
# input must not hang the planner).
READ_BATCHES = 4
READ_TIMEOUT_S = 120.


@dataclasses.dataclass(frozen=True)
class SequenceLength:
  """The time axis the planner sized a pipeline for.

  Attributes:
    length: The length profiled.
    read: The longest unpadded sequence of each Train batch read (empty when
      `length` was given).
    maximum: The input params' longest sequence (the bucket's bound), if
      they say.
    given: Whether `length` was given rather than read.
  """
  length: int
  read: Tuple[int, ...] = ()
  maximum: Optional[int] = None
  given: bool = False

  def Describe(self) -> str:
    """One line for the planner's output."""
    most = (f'; the input allows up to {self.maximum}'
            if self.maximum else '')
    if self.given:
      return f'sequence length {self.length} (given){most}'
    if not self.read:
      return (f"sequence length {self.length}: the input's maximum (its "
              'batches have no paddings to read lengths from)')
    return (f'sequence length {self.length}: the mean longest sequence of '
            f'{len(self.read)} Train batches read now '
            f"({', '.join(map(str, self.read))}){most}")


def Child(layer, part):
  """The child layer of `layer` that the params path part names."""
  name, _, index = part.partition('[')
  try:
    child = layer.children[name]
    return child[int(index.rstrip(']'))] if index else child
  except (KeyError, IndexError, ValueError, TypeError):
    raise ValueError(f'{part}: the task built no layer there from its '
                     'params; the planner plans the pipelines it finds as '
                     'children of the task.') from None


def TensorBytes(tensors) -> float:
  """The bytes of the tensors (or variables) of fully known shape."""
  return float(sum(t.shape.num_elements() * t.dtype.size for t in tensors
                   if t is not None and t.shape.is_fully_defined()))


def Tensors(nest):
  """The tensors of a nest (None and other values left out)."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  return [t for t in tf.nest.flatten(nest) if isinstance(t, tf.Tensor)]


def MaxLength(input_params) -> Optional[int]:
  """The input's longest sequence, if its params say (Lingvo's inputs)."""
  for key in ('target_max_length', 'source_max_length'):
    if key in input_params and input_params.Get(key):
      return int(input_params.Get(key))
  if 'bucket_upper_bound' in input_params and input_params.bucket_upper_bound:
    return int(max(input_params.bucket_upper_bound))
  return None


def _Dynamic(args) -> bool:
  """Whether a tensor of `args` has dims known only at run time."""
  return any(not t.shape.is_fully_defined() for t in Tensors(args))


def ReadLengths(input_params, batches: int = READ_BATCHES,
                timeout_s: float = READ_TIMEOUT_S) -> List[int]:
  """The longest unpadded sequence of each of `batches` input batches (TF).

  Reads them through the input's own generator, in a throw-away graph and
  session: what Lingvo's LM tasks trim the time axis to (the most of
  sum(1 - paddings) over the batch's rows). [] if the batch has no
  `paddings`.

  Raises:
    ValueError: one line, the input's name and the cause (a read that fails
      or takes over `timeout_s`).
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top

  from lingvo_ext.pipeline import cost  # pylint: disable=g-import-not-at-top
  p = input_params.Copy()
  # Only lengths are read: a small shuffle buffer fills at once.
  if 'file_buffer_size' in p and p.file_buffer_size:
    p.file_buffer_size = min(p.file_buffer_size, 10000)
  if 'num_batcher_threads' in p:
    p.num_batcher_threads = 1
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=1, split_size=1)
  with cost.Sandbox() as graph, cluster:
    batch = p.Instantiate().GetPreprocessedInputBatch()
    longest = [tf.reduce_max(tf.reduce_sum(1. - tf.cast(v, tf.float32), -1))
               for k, v in batch.FlattenItems()
               if k.split('.')[-1] == 'paddings' and v.shape.rank == 2]
  if not longest:
    return []
  out = []
  options = tf.RunOptions(timeout_in_ms=int(1000 * timeout_s))
  try:
    with tf.Session(graph=graph) as sess:
      for _ in range(batches):
        out.append(int(round(max(sess.run(longest, options=options)))))
  except tf.errors.DeadlineExceededError:
    raise ValueError(f'input {p.name}: no batch within {timeout_s:.0f} s '
                     'while the planner read its sequence lengths; check '
                     'its files and tokenizer.') from None
  except tf.errors.OpError as e:
    raise ValueError(f'input {p.name}: reading a batch for its sequence '
                     f'lengths failed: {_Cause(e.message)}; fix its files or '
                     'tokenizer params.') from None
  return out


def _Cause(message: str) -> str:
  """The cause line of a TF op error's message (not its node's traceback)."""
  skip = ('Graph execution error', 'Detected at node', 'File ', 'Node:', '[[')
  lines = [l.strip() for l in str(message).splitlines()]
  causes = [l for l in lines if l and not l.startswith(skip)]
  return causes[0] if causes else lines[0]


def RealLength(input_params, batches: int = READ_BATCHES
               ) -> Optional[SequenceLength]:
  """The SequenceLength read from `batches` Train batches (ReadLengths): the
  mean of their longest, rounded up; None if the batches have no paddings."""
  read = ReadLengths(input_params, batches)
  if not read:
    return None
  return SequenceLength(length=max(1, -(-sum(read) // len(read))),
                        read=tuple(read), maximum=MaxLength(input_params))


def Static(args, length, where):
  """`args` with each tensor of unknown dims replaced by zeros of `length`
  there (Lingvo's LM tasks trim the time axis to the batch's longest
  sequence)."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  def Fill(t):
    if not isinstance(t, tf.Tensor) or t.shape.is_fully_defined():
      return t
    if length is None or t.shape.rank is None:
      raise ValueError(f'{where}: an input of shape {t.shape} has unknown '
                       'dims and the input params name no max length; the '
                       'planner profiles static shapes.')
    return tf.zeros([length if d is None else d for d in t.shape.as_list()],
                    t.dtype)

  return tf.nest.map_structure(Fill, args)


def _ProfileCells(graph, layer, theta, args, batch, cluster):
  """The LayerProfile of each cell of pipeline `layer` on its inputs `args`.

  The cells are built again, in turn, on the inputs the pipeline got (in
  `graph`, where the task was built): each one's forward ops, the backward
  ops of tf.gradients, the activations those read, its FLOPs (TensorFlow's
  profiler, over the ops under the cell's name scope) and its variables.
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  from lingvo_ext.pipeline import nest_util  # pylint: disable=g-import-not-at-top
  inputs = nest_util.ToTuple(args)
  for bp in layer.params.before_tpl or []:
    inputs = nest_util.ToTuple(
        layer.children[bp.name].FProp(theta[bp.name], *inputs))
  stats, scopes = [], []
  for i, (name, cell) in enumerate(layer.Cells()):
    scope = 'planner_cell_%d' % i
    n0 = len(graph.get_operations())
    with tf.name_scope(scope), cluster:
      outs = cell.FProp(theta[name], *inputs)
    fwd = graph.get_operations()[n0:]
    floats = [o for o in Tensors(outs) if o.dtype.is_floating]
    n1 = len(graph.get_operations())
    loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in floats])
    xs = theta[name].Flatten() + [
        x for x in Tensors(inputs) if x.dtype.is_floating]
    tf.gradients(loss, xs)
    bwd = graph.get_operations()[n1:]
    variables = cell.vars.Flatten()
    out_bytes = TensorBytes(Tensors(outs)) / batch
    stats.append(dict(
        name=name, fwd_ops=tf_profiling.CountedOps(fwd),
        bwd_ops=tf_profiling.CountedOps(bwd), num_vars=len(variables),
        param_bytes=int(TensorBytes(variables)), out_bytes=out_bytes,
        kept_bytes=max(tf_profiling.KeptBytes(fwd, bwd) / batch,
                       out_bytes)))
    scopes.append(scope)
    inputs = nest_util.ToTuple(outs)
  out = []
  for s, scope in zip(stats, scopes):
    opts = (tf.compat.v1.profiler.ProfileOptionBuilder(
        tf.compat.v1.profiler.ProfileOptionBuilder.float_operation())
            .with_node_names(show_name_regexes=[scope + '/.*'])
            .with_empty_output().build())
    # Its note on the task's other ops (of unknown shapes) is not ours.
    with contextlib.redirect_stderr(io.StringIO()):
      flops = tf.compat.v1.profiler.profile(graph, options=opts).total_float_ops
    out.append(LayerProfile(flops=float(flops) / batch, **s))
  return out


def CapturePipelineInputs(task, pipelines, got):
  """{path: layer} of the task's pipelines (`pipeline_tree.Pipelines`), each
  made to record (theta, inputs) of its first run in got[path].

  On this throw-away instance only, through each pipeline's capture hook
  (its eval path, FPropSequential, calls it).
  """
  layers = {}
  for path, _ in pipelines:
    layer = task
    for part in path.split('.'):
      layer = Child(layer, part)
    layers[path] = layer

    def Capture(theta, args, _path=path):
      got.setdefault(_path, (theta, args))

    layer.AddCaptureHook(Capture)
  return layers


def EvalSettingsForProfiling(task_p):
  """Makes the eval settings of `task_p` (a throw-away copy) build in eval
  mode on the Train input.

  The task is built in eval mode only to run its pipelines in turn; Lingvo's
  BaseTask asserts eval.samples_per_summary > 0 for an input of unknown size
  (the Train input), and experiments meaning "the whole set" set it to 0
  (e.g. Lingvo's OneBWdsGPipeTransformer); it warns of batcher threads in
  eval mode. No evaluation runs here and the input is never read.
  """
  if 'eval' in task_p and task_p.eval is not None:
    if not task_p.eval.samples_per_summary:
      task_p.eval.samples_per_summary = 1
  if task_p.input is not None and 'num_batcher_threads' in task_p.input:
    task_p.input.num_batcher_threads = 1


def ProfileTree(model_params, name: str = '',
                length: Optional[int] = None) -> List[TreePipeline]:
  """Each pipeline of an experiment's params, profiled (TF).

  Builds the task's forward pass once, on one CPU device in a throw-away
  graph, and profiles each PipeliningLayer's cells on the inputs it got.
  A time axis the task trims at run time is sized by `length`, or else by
  a few Train batches read now (RealLength), or else by the input's
  maximum; each pipeline's `length` says which.

  Args:
    model_params: The experiment's params (overrides applied,
      --gpipe_engine=lingvo_ext), with `task` and `input`.
    name: The experiment's name, for messages.
    length: The sequence length to size for, or None (read it).
  """
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.pipeline import cost  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  pipelines = pipeline_tree.Pipelines(model_params.task)
  for path, p in pipelines:
    if not issubclass(p.cls, gpipe.PipeliningLayer):
      raise ValueError(f'task.{path} ({p.cls.__name__}) is Lingvo\'s; the '
                       'planner plans lingvo_ext\'s engine: pass '
                       '--gpipe_engine=lingvo_ext.')
  py_utils.SetEagerMode(False)
  task_p = model_params.task.Copy()
  task_p.input = model_params.input.Copy()
  EvalSettingsForProfiling(task_p)
  # Eval on one device: each pipeline runs its cells in turn
  # (FPropSequential) on the inputs the task gives it, recorded here; its
  # cells are then profiled as they train.
  evaler = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=1, split_size=1, do_eval=True)
  trainer = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=1, split_size=1, do_eval=False)
  got = {}
  out = []
  with cost.Sandbox() as graph:
    with evaler:
      py_utils.GetOrCreateGlobalStepVar()
      task = task_p.Instantiate()
      layers = CapturePipelineInputs(task, pipelines, got)
      task.FPropDefaultTheta()
    seq = None
    if any(_Dynamic(args) for _, args in got.values()):
      if length is not None:
        seq = SequenceLength(int(length), given=True,
                             maximum=MaxLength(model_params.input))
      else:
        seq = RealLength(model_params.input)
      if seq is None and MaxLength(model_params.input):
        seq = SequenceLength(MaxLength(model_params.input),
                             maximum=MaxLength(model_params.input))
    for path, p in pipelines:
      if path not in got:
        raise ValueError(f'task.{path} ({p.cls.__name__}) is not run by the '
                         "task's forward pass; the planner plans the "
                         'pipelines it runs.')
      theta, args = got[path]
      dynamic = _Dynamic(args)
      args = Static(args, seq.length if seq else None, f'task.{path}')
      batch = [t for t in Tensors(args) if t.shape.rank][0].shape.as_list()[
          p.batch_dim]
      first = [t for t in Tensors(args) if t.dtype.is_floating]
      out.append(TreePipeline(
          path='task.' + path, cls_name=p.cls.__name__,
          micro_batch_size=p.micro_batch_size,
          length=seq if dynamic else None,
          profile=ModelProfile(
              name=f'{name or task_p.name}:task.{path}',
              layers=tuple(_ProfileCells(graph, layers[path], theta, args,
                                         batch, trainer)),
              batch=int(batch), in_bytes=TensorBytes(first) / batch,
              optimizer_slots=tf_profiling.OptimizerSlots(task_p),
              linear_loss=False, cell_functions=bool(p.cell_functions))))
  return out


def EmptyCells(pipe: TreePipeline) -> List[str]:
  """The cells of `pipe` that hold no layer: no variables, no FLOPs, no ops
  (e.g. Lingvo's stacks with `splits` beyond their layers)."""
  return [l.name for l in pipe.profile.layers
          if not (l.num_vars or l.flops or l.fwd_ops)]


def _Ranked(pipe: TreePipeline, devices: int,
            memory_per_device: Optional[float],
            machine: Machine) -> List[Candidate]:
  """Its plans with its own cells (K as cut), one replica, ranked."""
  k = len(pipe.profile.layers)
  empty = EmptyCells(pipe)
  if empty:
    raise PlanError(
        f'{pipe.path}: cells {", ".join(empty)} hold no layer ({k} cells, '
        'more than the layers to cut); use fewer cells, e.g. a lower '
        f'{pipe.path}.splits.')
  plans = [p for p in Enumerate(pipe.profile, devices, sync_choices=('shared',),
                                static_shapes=pipe.length is None)
           if p.num_cells == k and p.replicas == 1]
  if not plans:
    raise PlanError(f'{pipe.path}: no plan keeps its {k} cells on '
                    f'{devices} devices with a micro-batch count dividing '
                    f'its batch {pipe.profile.batch}; pass more --devices.')
  return Rank(PredictAll(pipe.profile, plans, machine), memory_per_device)


def ChooseTree(pipes: Sequence[TreePipeline], devices: int,
               memory_per_device: Optional[float] = None,
               machine: Machine = Machine()
               ) -> List[Tuple[TreePipeline, List[Candidate]]]:
  """Each pipeline with its ranked plans, the chosen first (PlanError if none).

  The first pipeline's best plan sets the devices; every other pipeline
  takes its best plan on as many devices (they share the model split).
  """
  out = []
  for pipe in pipes:
    ranked = _Ranked(pipe, devices, memory_per_device, machine)
    if out:
      d = out[0][1][0].devices_per_replica
      same = [c for c in ranked if c.devices_per_replica == d]
      if not same:
        raise PlanError(f'{pipe.path}: no plan on the {d} devices '
                        f'{out[0][0].path} takes; plan it by hand.')
      ranked.remove(same[0])
      ranked.insert(0, same[0])
    out.append((pipe, ranked))
  return out


def TreeOverrides(pipe: TreePipeline, plan) -> Dict[str, object]:
  """The params the plan sets on the pipeline: override key -> value."""
  out = {
      f'{pipe.path}.num_micro_batches': plan.num_micro_batches,
      f'{pipe.path}.schedule': plan.schedule,
      # As application.Overrides: None lets the schedule decide.
      f'{pipe.path}.recompute': (
          None if plan.schedule in records.ALWAYS_RECOMPUTE +
          records.LINEAR_LOSS_ONLY else plan.recompute),
  }
  if pipe.micro_batch_size:
    out[f'{pipe.path}.micro_batch_size'] = None
  return out


def TreeOverrideString(chosen: Sequence[Tuple[TreePipeline, object]]) -> str:
  """The --model_params_override text of each pipeline's chosen plan."""
  items = []
  for pipe, plan in chosen:
    for key, value in TreeOverrides(pipe, plan).items():
      text = '"%s"' % value if isinstance(value, str) else str(value)
      items.append('%s:%s' % (key, text))
  return '; '.join(items)


def ApplyTree(model_params, chosen: Sequence[Tuple[TreePipeline, object]]):
  """Sets each pipeline's chosen plan on `model_params` (changed in place),
  typed: the values of `TreeOverrides`, whose text is TreeOverrideString."""
  for pipe, plan in chosen:
    application.SetKeys(model_params, TreeOverrides(pipe, plan))
  return model_params
