"""The memory estimate at start, before the model is built (no --plan=auto).

The trainer predicts the peak RSS of the plan the experiment's params give
(`EstimateRun`, planner/memory_model.py, this machine's constants from
planner/memory_probe.py): the runtime, parameters, their gradients,
optimizer slots, the activations the schedule and recompute keep, the
step's transient peak, the input and the graph. A lingvo_ext `PipelinedTask`
is read from its layers' FPropMeta, variables and gradient graphs, no model
built (`Profile`); an experiment holding pipelines in its Params tree (e.g.
Lingvo's GPipeTransformerLm) from one forward build of its task in a
throw-away graph (planner/tree_memory.py), each pipeline with its own
switches, e.g. task.lm.stack.num_micro_batches, and its graph term from the
nodes of its training step built meanwhile in a process of its own
(NodeCount). When the prediction exceeds the memory this process
may use (memory_check.AvailableBytes), one line warns
with the least override that fits by the same model (`Overrides`); the
launcher checks each worker task (`LaunchWarnings`). docs/faults.md,
"Memory".
"""

import contextlib
import dataclasses
import logging
import sys
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

from lingvo_ext import devices
from lingvo_ext.distributed import task_health
from lingvo_ext.planner import memory_model
from lingvo_ext.preflight import memory_check


@dataclasses.dataclass(frozen=True)
class StartEstimate:
  """The planner's memory prediction for the plan an experiment's params give.

  Attributes:
    plan: The planner's Plan read off the params.
    process_bytes: All the process's devices: parameters, their gradients,
      optimizer slots and the activations the schedule keeps.
    peak_bytes: The fullest device's share.
    activation_bytes: The part of process_bytes that is kept activations.
    rss_bytes: The process's predicted peak RSS (planner/memory_model.py),
      runtime included; 0 where no memory constants were given.
    rss_terms: Its terms, name -> bytes (they add up to rss_bytes).
  """
  plan: object
  process_bytes: float
  peak_bytes: float
  activation_bytes: float
  rss_bytes: float = 0.
  rss_terms: Dict[str, float] = dataclasses.field(default_factory=dict)


def Profile(model_params):
  """The planner's ModelProfile of a PipelinedTask experiment, no model built.

  Each distinct layer is built once in a throw-away graph with its
  gradients (nothing runs): FLOPs from its FPropMeta, parameter bytes from
  its variables, and the activations kept as the tensors of its forward pass
  its backward pass reads (tf_profiling.ProfileLayers).
  """
  from lingvo_ext.planner import tf_profiling  # pylint: disable=g-import-not-at-top
  profile = tf_profiling.ProfileExperiment(model_params)
  # The layers are profiled in float32: bf16 activations take half (as the
  # override that names task.fprop_dtype was estimated).
  task = model_params.task
  if _IsBf16(task.fprop_dtype if 'fprop_dtype' in task else None):
    profile = _Half(profile)
  return profile


def _IsBf16(dtype) -> bool:
  return str(dtype) in ('bfloat16', "<dtype: 'bfloat16'>")


DefaultRecompute = memory_model.DefaultRecompute
PlanOfParams = memory_model.PlanOfParams


def _Half(profile):
  """The profile with its activations in a 2-byte dtype (bf16)."""
  layers = tuple(dataclasses.replace(l, out_bytes=l.out_bytes / 2,
                                     kept_bytes=l.kept_bytes / 2)
                 for l in profile.layers)
  return dataclasses.replace(profile, layers=layers,
                             in_bytes=profile.in_bytes / 2)


def Estimate(profile, plan, constants=None) -> StartEstimate:
  """The planner's memory prediction of `plan` (prediction.Predict); with
  `constants` (memory_model.Constants), the process's peak RSS too."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  got = planner.Predict(profile, plan)
  layers = tuple(dataclasses.replace(l, out_bytes=0., kept_bytes=0.)
                 for l in profile.layers)
  bare = planner.Predict(
      dataclasses.replace(profile, layers=layers, in_bytes=0.), plan)
  rss = {}
  if constants is not None:
    rss = memory_model.Predict(profile, plan, constants).Terms()
  return StartEstimate(plan, got.process_bytes, got.peak_bytes,
                       got.process_bytes - bare.process_bytes,
                       float(sum(rss.values())), rss)


def _Fits(profile, plan, available: float,
          constants) -> Optional[StartEstimate]:
  """The plan's estimate if the builder takes it and its peak RSS fits."""
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  if records.RecomputeError(plan.schedule, plan.recompute, '') or (
      records.Refusal(plan.schedule, plan.num_cells, plan.devices_per_replica,
                      plan.num_micro_batches)):
    return None
  got = Estimate(profile, plan, constants)
  return got if got.rss_bytes <= available else None


def Overrides(profile, plan, fprop_dtype, available: float, constants,
              prefix: str = 'task', bf16: bool = True,
              micro_batch_size: bool = False
              ) -> Optional[Tuple[str, StartEstimate]]:
  """The override (text, its estimate) of the least change that fits.

  Tried in turn: more micro-batches (the fewest that fit), recompute, each
  schedule that keeps fewer activations (with the micro-batches they need),
  then bf16 activations (task.fprop_dtype) with each of those.

  Args:
    profile: The planner's ModelProfile.
    plan: The plan the params give.
    fprop_dtype: The params' activation dtype.
    available: The peak RSS the plan's estimate may reach (memory_model's,
      runtime included; for one of several pipelines, the others' bytes
      taken off).
    constants: memory_model.Constants.
    prefix: The params path of the pipeline's switches, e.g. 'task.lm.stack'.
    bf16: Whether to try bf16 activations (`task.fprop_dtype`).
    micro_batch_size: Whether the pipeline's params set micro_batch_size
      (reset to None when the micro-batches change).
  """
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  rb = plan.replica_batch
  more = [m for m in range(plan.num_micro_batches + 1, rb + 1) if rb % m == 0]
  changes: List[Tuple[dict, object]] = [({}, plan)]
  if not plan.recompute:
    changes.append(({f'{prefix}.recompute': True},
                    dataclasses.replace(plan, recompute=True)))
  for name in records.NAMES:
    if name != plan.schedule:
      record = records.Get(name)
      rc = record.RecomputeChoices(profile.linear_loss)[0]
      change = {f'{prefix}.schedule': name}
      if rc != DefaultRecompute(record, profile.linear_loss):
        change[f'{prefix}.recompute'] = rc
      changes.append((change, dataclasses.replace(plan, schedule=name,
                                                  recompute=rc)))
  dtypes = [({}, profile)]
  if bf16 and not _IsBf16(fprop_dtype):
    dtypes.append(({'task.fprop_dtype': 'bfloat16'}, _Half(profile)))
  for dtype, prof in dtypes:
    for change, base in changes:
      for m in [base.num_micro_batches] + more:
        candidate = dataclasses.replace(base, num_micro_batches=m)
        got = _Fits(prof, candidate, available, constants)
        if got is None:
          continue
        keys = dict(change, **dtype)
        if m != plan.num_micro_batches:
          keys[f'{prefix}.num_micro_batches'] = m
          if micro_batch_size:
            keys[f'{prefix}.micro_batch_size'] = None
        if not keys:
          continue
        text = '; '.join(
            f'{k}:"{v}"' if isinstance(v, str) else f'{k}:{v}'
            for k, v in sorted(keys.items()))
        return text, got
  return None


def StartWarning(model_params, num_cpu_devices: int, split: int,
                 overrides: str = '', available=None, source: str = '',
                 constants=None) -> Optional[str]:
  """The one warning line when the params' plan may not fit, or None.

  The need is the process's predicted peak RSS (EstimateRun); the override
  named is re-estimated by the same model and fits.

  Args:
    model_params: The experiment's params (overrides applied): a
      PipelinedTask's, or any holding pipelines in its Params tree.
    num_cpu_devices: --num_cpu_devices.
    split: --worker_split_size.
    overrides: The user's --model_params_override (the line's override
      follows it).
    available: The bytes the process may use (tests pass a value); None:
      memory_check.AvailableBytes().
    source: Where `available` comes from.
    constants: memory_model.Constants; None: this machine's (memory_probe).
  """
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  task = model_params.task if 'task' in model_params else None
  if task is None:
    return None
  if available is None:
    available, source = memory_check.AvailableBytes()
  if available is None:
    return None
  if constants is None:
    constants = memory_probe.Get(max(1, num_cpu_devices))
  if not pipeline_tree.IsPipelinedTask(task):
    return TreeWarning(model_params, num_cpu_devices, split, overrides,
                       available, source, constants)
  profile = Profile(model_params)
  plan = PlanOfParams(profile, task, num_cpu_devices, split)
  got = _WithInput(Estimate(profile, plan, constants), model_params)
  if got.rss_bytes <= available:
    return None
  line = NeedLine(got, Kept('task', plan), available, source)
  buffered = got.rss_terms.get('input_buffer', 0.)
  fit = Overrides(profile, plan, task.fprop_dtype, available - buffered,
                  constants)
  if fit is None:
    return line + ('no override of micro-batches, recompute, schedule or '
                   'bf16 fits; use more memory or more devices.')
  text, fits = fit
  return line + FitLine(buffered + fits.rss_bytes, overrides, text)


Size = task_health.FormatBytes


def Kept(prefix: str, plan) -> str:
  """What the plan's kept activations are, in the params' words."""
  rc = 'with' if plan.recompute else 'without'
  return (f'the activations {prefix}.schedule="{plan.schedule}" keeps over '
          f'{plan.num_micro_batches} micro-batch(es) {rc} recompute')


def TermsText(terms) -> str:
  """'runtime 1.0GB, activations 3.4GB, ...': the terms of 1MB or more, the
  largest first."""
  big = sorted(((b, n) for n, b in terms.items() if b >= 2**20),
               reverse=True)
  return ', '.join(f'{n} {Size(b)}' for b, n in big)


def NeedLine(got: StartEstimate, what: str, available: float,
             source: str) -> str:
  """The warning's first half: the need (the predicted peak RSS), its
  terms, what the activations are, and the memory."""
  return (f'warning: the run needs about {Size(got.rss_bytes)} '
          f'({TermsText(got.rss_terms)}; {what}), but '
          f'{source or "the memory"} is {Size(available)}: it may be killed '
          'by the OOM killer; ')


def FitLine(need: float, overrides: str, text: str) -> str:
  """The warning's second half: the override that fits."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  return (f'an override that fits (about {Size(need)}): '
          f"--model_params_override='"
          f"{planner.JoinOverrides(overrides, text)}'.")

def PlanOfPipeline(pipe, params, num_cpu_devices: int, split: int):
  """The planner's Plan of a pipeline's own params (its cells as cut)."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  k = len(pipe.profile.layers)
  recompute = params.recompute
  if recompute is None:
    recompute = DefaultRecompute(records.Get(params.schedule),
                                 pipe.profile.linear_loss)
  replicas = devices.Replicas(num_cpu_devices, split)
  return planner.Plan(
      num_cells=k, sizes=(1,) * k, devices_per_replica=max(1, min(split, k)),
      num_micro_batches=params.num_micro_batches, schedule=params.schedule,
      recompute=bool(recompute), replicas=replicas, gradient_sync='shared',
      global_batch=pipe.profile.batch * replicas)


def TreeWarning(model_params, num_cpu_devices: int, split: int,
                overrides: str, available: float, source: str,
                constants) -> Optional[str]:
  """StartWarning for an experiment whose pipelines sit in its Params tree.

  Each pipeline is estimated under its own params; the task's variables
  outside them count with their gradients and optimizer slots. The override
  sets one pipeline's switches. None for an experiment with no pipeline (the
  controller checks its built variables).
  """
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  if not pipeline_tree.Pipelines(model_params.task):
    return None
  mem, nodes = _ProfileWithNodes(model_params, num_cpu_devices, split,
                                 constants)
  got = _TreeEstimate(mem, num_cpu_devices, split, constants,
                      _InputBuffer(model_params), nodes)
  if got.rss_bytes <= available:
    return None
  kept = ' and '.join(Kept(pipe.path, plan)
                      for pipe, plan in zip(mem.pipes, got.plan))
  line = NeedLine(got, kept, available, source)
  for pipe, plan in zip(mem.pipes, got.plan):
    own = Estimate(pipe.profile, plan, constants).rss_bytes
    rest = got.rss_bytes - own
    fit = Overrides(pipe.profile, plan, None, available - rest, constants,
                    prefix=pipe.path, bf16=False,
                    micro_batch_size=bool(pipe.micro_batch_size))
    if fit is not None:
      text, fits = fit
      return line + FitLine(rest + fits.rss_bytes, overrides, text)
  return line + ('no override of micro-batches, recompute or schedule fits; '
                 'use more memory or more devices.')


@contextlib.contextmanager
def _LingvoQuiet():
  """Lingvo's and TensorFlow's Python warnings held back for the block."""
  loggers = [logging.getLogger(n) for n in ('absl', 'tensorflow')]
  levels = [l.level for l in loggers]
  for l in loggers:
    l.setLevel(logging.ERROR)
  try:
    yield
  finally:
    for l, level in zip(loggers, levels):
      l.setLevel(level)


def WarnAtStart(model_params, num_cpu_devices: int, split: int,
                overrides: str, prefix: str = '') -> Optional[str]:
  """Prints StartWarning's line, if any, to stderr, once; returns it (the
  trainer writes it to its log once the log goes to the file).

  In the memory probe's own trainer runs it predicts nothing (its constants
  are being measured).

  An experiment the estimate cannot read (a layer without FPropMeta, a task
  whose throw-away build fails) gets no line, a note in the log: the real
  build reports its own errors, and the controller's check of the built
  variables still runs.
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  if memory_probe.InProbe():
    return None
  try:
    # The estimate instantiates the layers: Lingvo's warnings about them
    # belong to the real build, after the trainer's first line.
    with _LingvoQuiet():
      line = StartWarning(model_params, num_cpu_devices, split, overrides)
  except Exception as e:  # pylint: disable=broad-except
    # A warning's estimate never stops the run it warns about.
    tf.logging.info('No memory estimate at start: %s: %s',
                    type(e).__name__, e)
    return None
  if line:
    line = prefix + line
    print(line, file=sys.stderr, flush=True)
  return line


def EstimateRun(model_params, num_cpu_devices: int, split: int,
                constants=None) -> Optional[StartEstimate]:
  """The StartEstimate of the run the params give, its peak RSS included.

  Args:
    model_params: The experiment's params (overrides applied).
    num_cpu_devices: --num_cpu_devices.
    split: --worker_split_size.
    constants: memory_model.Constants; None: this machine's
      (memory_probe.Get, probed on first use).

  Returns:
    None for an experiment with no pipeline the estimate reads. For one
    whose pipelines sit in its Params tree: `plan` is the list of each
    pipeline's, the bytes all pipelines' and the task's other variables'.
  """
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  task = model_params.task if 'task' in model_params else None
  if task is None:
    return None
  if constants is None:
    constants = memory_probe.Get(max(1, num_cpu_devices))
  if pipeline_tree.IsPipelinedTask(task):
    profile = Profile(model_params)
    got = Estimate(profile, PlanOfParams(profile, task, num_cpu_devices,
                                         split), constants)
    return _WithInput(got, model_params)
  if not pipeline_tree.Pipelines(task):
    return None
  mem, nodes = _ProfileWithNodes(model_params, num_cpu_devices, split,
                                 constants)
  return _TreeEstimate(mem, num_cpu_devices, split, constants,
                       _InputBuffer(model_params), nodes)


def _ProfileWithNodes(model_params, num_cpu_devices: int, split: int,
                      constants):
  """tree_memory.ProfileWithNodes; no training graph built to count its
  nodes where a node weighs nothing (constants.bytes_per_op 0)."""
  from lingvo_ext.planner import tree_memory  # pylint: disable=g-import-not-at-top
  if not constants.bytes_per_op:
    return tree_memory.ProfileTaskMemory(model_params), None
  return tree_memory.ProfileWithNodes(model_params, num_cpu_devices, split)


def _InputBuffer(model_params) -> float:
  """The input's record buffer (planner/input_memory.py), 0 without one."""
  from lingvo_ext.planner import input_memory  # pylint: disable=g-import-not-at-top
  return input_memory.RunBufferBytes(model_params)


def _WithInput(got: StartEstimate, model_params) -> StartEstimate:
  """`got` with the input's record buffer in its peak RSS."""
  if not got.rss_terms:
    return got
  terms = dict(got.rss_terms)
  terms['input_buffer'] = terms.get('input_buffer', 0.) + _InputBuffer(
      model_params)
  return dataclasses.replace(got, rss_bytes=float(sum(terms.values())),
                             rss_terms=terms)


def _TreeEstimate(mem, num_cpu_devices: int, split: int,
                  constants, input_buffer: float = 0.,
                  graph_nodes: Optional[float] = None) -> StartEstimate:
  """EstimateRun of a tree_memory.TaskMemory; `plan` is the list of each
  pipeline's plan; `input_buffer`: the input's record buffer's bytes;
  `graph_nodes`: the built training graph's (TrainingGraphNodes), else
  each pipeline's predicted and the task's other ops'."""
  plans = [PlanOfPipeline(pipe, p, num_cpu_devices, split)
           for pipe, p in zip(mem.pipes, mem.params)]
  got = [Estimate(pipe.profile, plan) for pipe, plan in zip(mem.pipes, plans)]
  rss = None
  for pipe, plan in zip(mem.pipes, plans):
    one = memory_model.Predict(pipe.profile, plan, constants)
    rss = one if rss is None else rss.Plus(one)
  from lingvo_ext.planner import tree_memory  # pylint: disable=g-import-not-at-top
  others = mem.other_param_bytes
  extra = tree_memory.OtherTerms(mem, constants.bytes_per_op)
  graph = rss.Terms()['graph']
  if graph_nodes is not None:
    extra['graph'] = graph_nodes * constants.bytes_per_op - graph
  for term, value in extra.items():
    rss = memory_model.Extra(rss, term, value)
  rss = memory_model.Extra(rss, 'input_buffer', input_buffer)
  weights = others * (2 + mem.optimizer_slots)
  return StartEstimate(
      plans, weights + sum(g.process_bytes for g in got),
      weights + max(g.peak_bytes for g in got),
      sum(g.activation_bytes for g in got), rss.rss_bytes, rss.Terms())


def LaunchWarnings(model: str, overrides: str, num_workers: int,
                   num_cpu_devices: int, split: int, available=None,
                   source: str = '', constants=None) -> List[str]:
  """lingvo_ext.launch's start-up check: a line per worker task, prefixed
  with its name as its other lines, when its share may not fit.

  Each worker holds a replica's cells on its --num_cpu_devices devices
  (the local trainer's estimate there); the workers share this host, so
  each may use an even share of what the launcher may use.
  """
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  if available is None:
    available, source = memory_check.AvailableBytes()
  if available is None:
    return []
  share = available / max(1, num_workers)
  if num_workers > 1:
    source = f'{source or "the memory"} over {num_workers} worker tasks'
  cfg = experiment_params.GetParams(model, 'Train', overrides)
  with _LingvoQuiet():
    line = StartWarning(cfg, num_cpu_devices, min(split, num_cpu_devices),
                        overrides, share, source, constants)
  if not line:
    return []
  return [f'[worker{t}] {line}' for t in range(num_workers)]
