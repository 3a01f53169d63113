"""Memory: the planner's estimate against what the machine (or cgroup) has.

With --plan=auto the planner has predicted the chosen plan's memory
(parameters, optimizer slots, the activations its schedule and recompute
keep, the graph and the process's own); before the model is built, the
trainer compares it with the memory this process may use (its cgroup's
limit, else MemAvailable) and, when it does not fit, warns in one line with
the override of the fastest plan that does (more micro-batches, recompute, a
schedule that keeps fewer activations), or says that none does. Without
--plan=auto, the trainer estimates the plan its params give (`Estimate`:
the planner's prediction from the layers' FPropMeta, no graph built) and
warns in one line with an override that fits (`StartWarning`); a local
run's controller also compares the built graph's variables (parameters,
optimizer slots) with it, before a session allocates them.
"""

import contextlib
import dataclasses
import logging
import os
import sys
from typing import List, Optional, Tuple

from lingvo_ext.distributed import task_health


def AvailableBytes() -> Tuple[Optional[int], str]:
  """(bytes this process may use, where that figure comes from)."""
  limit = task_health.MemoryLimit(task_health.CgroupDir(os.getpid()))
  available = None
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          available = int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  if limit is not None and (available is None or limit < available):
    return limit, "the cgroup's memory limit"
  return available, "this machine's available memory"


def PlanWarning(needed: float, devices: int, available: Optional[float],
                source: str, fit: Optional[str]) -> Optional[str]:
  """The one warning line when `needed` bytes exceed `available`, or None.

  Args:
    needed: The process's predicted bytes (all its devices).
    devices: The devices it plans for (per-device figure in the line).
    available: What the process may use (AvailableBytes), or None.
    source: Where `available` comes from.
    fit: The override (and flags) of a plan that fits, or None if none does.
  """
  if available is None or needed <= available:
    return None
  size = task_health.FormatBytes
  line = (f'warning: the plan needs about {size(needed)} '
          f'({size(needed / max(1, devices))} per device, {devices} '
          f'device(s)) but {source} is {size(available)}: it may be killed '
          'by the OOM killer; ')
  if fit:
    return line + f'a plan that fits: {fit}.'
  return line + ('no plan fits; use more memory, more devices (--devices) '
                 'or bf16 (task.fprop_dtype).')


def CheckAutoPlan(plan, devices: int, replan, available=None,
                  source: str = '') -> Optional[str]:
  """--plan=auto: the warning line for the chosen `plan`, or None.

  Args:
    plan: The planner's chosen Candidate, or [(pipeline, Candidate)] for an
      experiment whose pipelines come cut.
    devices: --devices.
    replan: Called with a per-device budget in bytes; returns the
      (override text, trainer flags dict) of the fastest plan within it, or
      raises ValueError when none fits.
    available: The bytes the process may use (tests pass a value); None:
      AvailableBytes().
    source: Where `available` comes from.
  """
  chosen = [c for _, c in plan] if isinstance(plan, list) else [plan]
  needed = max(c.process_bytes for c in chosen)
  if available is None:
    available, source = AvailableBytes()
  if available is None or needed <= available:
    return None
  try:
    text, flags = replan(int(available / max(1, devices)))
    fit = ' '.join(f'--{k}={v}' for k, v in flags.items()) + (
        f" --model_params_override='{text}'")
  except ValueError:
    fit = None
  return PlanWarning(needed, devices, available, source or 'the memory',
                     fit)


def VariablesWarning(variable_bytes: float, available=None,
                     source: str = '') -> Optional[str]:
  """The warning line when the built model's variables alone do not fit.

  Without --plan=auto there is no prediction of the activations; the
  variables (parameters, optimizer slots) are known once the graph is built,
  before the session allocates them.
  """
  if available is None:
    available, source = AvailableBytes()
  if available is None or variable_bytes <= available:
    return None
  size = task_health.FormatBytes
  return (f'warning: the model\'s variables and optimizer slots alone take '
          f'{size(variable_bytes)}, more than {source} ({size(available)}): '
          'it may be killed by the OOM killer; run it on more memory, with '
          'bf16 (task.fprop_dtype), or let --plan=auto --devices=N '
          '--memory_per_device=SIZE choose a plan that fits.')


def GraphVariableBytes(graph) -> int:
  """Bytes of the global variables of a built graph (static shapes)."""
  total = 0
  for v in graph.get_collection('variables'):
    shape = v.shape
    if not shape.is_fully_defined():
      continue
    total += shape.num_elements() * v.dtype.base_dtype.size
  return total


# --- The estimate at start, without --plan=auto -------------------------------


@dataclasses.dataclass(frozen=True)
class StartEstimate:
  """The planner's memory prediction for the plan an experiment's params give.

  Attributes:
    plan: The planner's Plan read off the params.
    process_bytes: All the process's devices: parameters, their gradients,
      optimizer slots and the activations the schedule keeps.
    peak_bytes: The fullest device's share.
    activation_bytes: The part of process_bytes that is kept activations.
  """
  plan: object
  process_bytes: float
  peak_bytes: float
  activation_bytes: float


def Profile(model_params):
  """The planner's ModelProfile of a PipelinedTask experiment, cheaply.

  FLOPs and outputs from each layer's FPropMeta, parameter bytes from its
  variables (each distinct layer instantiated once in a throw-away graph);
  no FProp is built, so the kept activations are each layer's outputs (a
  lower bound: the planner's --plan=auto profile counts what the backward
  pass reads) and the graph's ops are not counted.
  """
  import math  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core import cost  # pylint: disable=g-import-not-at-top
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  task = model_params.task.Copy()
  task.input = model_params.input.Copy()
  stack, shapes = task.cls.LayerStack(task)
  metas = cost.LayerMetas(stack, *shapes)
  in_shape = shapes[0].ToTensorShape().as_list()
  batch = int(in_shape[0])
  sizes = {}
  layers = []
  for p, meta in zip(stack, metas):
    key = p.Copy().Set(name='x').ToText()
    if key not in sizes:
      variables = cost.LayerVariables(p)
      sizes[key] = (sum(math.prod(s) * d.size for _, s, d in variables),
                    len(variables))
    out_bytes = cost.ActivationBytes(meta.out_shapes) / batch
    layers.append(planner.LayerProfile(
        name=p.name, flops=float(meta.flops) / batch, fwd_ops=0, bwd_ops=0,
        param_bytes=int(sizes[key][0]), num_vars=sizes[key][1],
        out_bytes=out_bytes, kept_bytes=out_bytes))
  return planner.ModelProfile(
      name=task.name, layers=tuple(layers), batch=batch,
      in_bytes=4. * math.prod(in_shape[1:]),
      optimizer_slots=planner.OptimizerSlots(task), linear_loss=False,
      cell_functions=bool(task.Get('cell_functions')))


def _DefaultRecompute(record, linear_loss: bool) -> bool:
  """What recompute=None means for a schedule (records.Schedule)."""
  from lingvo_ext.core.engine import records  # pylint: disable=g-import-not-at-top
  return record.recompute == records.ALWAYS or (
      record.recompute == records.WHEN_NEEDED and not linear_loss)


def PlanOfParams(profile, task, num_cpu_devices: int, split: int):
  """The planner's Plan of the task's params on the trainer's devices."""
  from lingvo_ext.core import partitioning  # pylint: disable=g-import-not-at-top
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core.engine import records  # pylint: disable=g-import-not-at-top
  k = min(task.num_partitions, len(profile.layers))
  costs = [l.param_bytes if task.partition_cost == 'params' else l.flops
           for l in profile.layers]
  recompute = task.recompute
  if recompute is None:
    recompute = _DefaultRecompute(records.Get(task.schedule),
                                  profile.linear_loss)
  replicas = max(1, num_cpu_devices // max(1, split))
  return planner.Plan(
      num_cells=k, sizes=tuple(partitioning.MinMaxPartition(costs, k)),
      devices_per_replica=max(1, min(split, k)),
      num_micro_batches=task.num_micro_batches, schedule=task.schedule,
      recompute=bool(recompute), replicas=replicas,
      gradient_sync=task.gradient_sync,
      global_batch=profile.batch * replicas)


def _Half(profile):
  """The profile with its activations in a 2-byte dtype (bf16)."""
  layers = tuple(dataclasses.replace(l, out_bytes=l.out_bytes / 2,
                                     kept_bytes=l.kept_bytes / 2)
                 for l in profile.layers)
  return dataclasses.replace(profile, layers=layers,
                             in_bytes=profile.in_bytes / 2)


def Estimate(profile, plan) -> StartEstimate:
  """The planner's memory prediction of `plan` (prediction.Predict)."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  got = planner.Predict(profile, plan)
  layers = tuple(dataclasses.replace(l, out_bytes=0., kept_bytes=0.)
                 for l in profile.layers)
  bare = planner.Predict(
      dataclasses.replace(profile, layers=layers, in_bytes=0.), plan)
  return StartEstimate(plan, got.process_bytes, got.peak_bytes,
                       got.process_bytes - bare.process_bytes)


def _Fits(profile, plan, available: float) -> Optional[StartEstimate]:
  """The plan's estimate if the builder takes it and it fits."""
  from lingvo_ext.core.engine import records  # pylint: disable=g-import-not-at-top
  if records.RecomputeError(plan.schedule, plan.recompute, '') or (
      records.Refusal(plan.schedule, plan.num_cells, plan.devices_per_replica,
                      plan.num_micro_batches)):
    return None
  got = Estimate(profile, plan)
  return got if got.process_bytes <= available else None


def Overrides(profile, plan, fprop_dtype, available: float
              ) -> Optional[Tuple[str, StartEstimate]]:
  """The override (text, its estimate) of the least change that fits.

  `available`: the bytes the model may take (the process's own taken off).

  Tried in turn: more micro-batches (the fewest that fit), recompute, each
  schedule that keeps fewer activations (with the micro-batches they need),
  then bf16 activations (task.fprop_dtype) with each of those.
  """
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core.engine import records  # pylint: disable=g-import-not-at-top
  rb = plan.replica_batch
  more = [m for m in range(plan.num_micro_batches + 1, rb + 1) if rb % m == 0]
  changes: List[Tuple[dict, object]] = [({}, plan)]
  if not plan.recompute:
    changes.append(({'task.recompute': True},
                    dataclasses.replace(plan, recompute=True)))
  for name in records.NAMES:
    if name != plan.schedule:
      record = records.Get(name)
      rc = record.RecomputeChoices(profile.linear_loss)[0]
      change = {'task.schedule': name}
      if rc != _DefaultRecompute(record, profile.linear_loss):
        change['task.recompute'] = rc
      changes.append((change, dataclasses.replace(plan, schedule=name,
                                                  recompute=rc)))
  dtypes = [({}, profile)]
  if str(fprop_dtype) not in ('bfloat16', "<dtype: 'bfloat16'>"):
    dtypes.append(({'task.fprop_dtype': 'bfloat16'}, _Half(profile)))
  for dtype, prof in dtypes:
    for change, base in changes:
      for m in [base.num_micro_batches] + more:
        candidate = dataclasses.replace(base, num_micro_batches=m)
        got = _Fits(prof, candidate, available)
        if got is None:
          continue
        keys = dict(change, **dtype)
        if m != plan.num_micro_batches:
          keys['task.num_micro_batches'] = m
        if not keys:
          continue
        text = '; '.join(
            f'{k}:"{v}"' if isinstance(v, str) else f'{k}:{v}'
            for k, v in sorted(keys.items()))
        return text, got
  return None


def StartWarning(model_params, num_cpu_devices: int, split: int,
                 overrides: str = '', available=None,
                 source: str = '') -> Optional[str]:
  """The one warning line when the params' plan may not fit, or None.

  Args:
    model_params: The experiment's params (overrides applied); only a
      PipelinedTask's are estimated.
    num_cpu_devices: --num_cpu_devices.
    split: --worker_split_size.
    overrides: The user's --model_params_override (the line's override
      follows it).
    available: The bytes the process may use (tests pass a value); None:
      AvailableBytes().
    source: Where `available` comes from.
  """
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  task = model_params.task if 'task' in model_params else None
  if task is None or not pipeline_tree.IsPipelinedTask(task):
    return None
  profile = Profile(model_params)
  plan = PlanOfParams(profile, task, num_cpu_devices, split)
  got = Estimate(profile, plan)
  own = auto.PROCESS_OVERHEAD_BYTES  # TensorFlow's and the process's.
  if available is None:
    available, source = AvailableBytes()
  if available is None or got.process_bytes + own <= available:
    return None
  size = task_health.FormatBytes
  rc = 'with' if plan.recompute else 'without'
  line = (f'warning: the run needs about {size(got.process_bytes + own)}: '
          f'the model {size(got.process_bytes)} ({size(got.peak_bytes)} on '
          f'its fullest device; {size(got.activation_bytes)} of it the '
          f'activations task.schedule="{plan.schedule}" keeps over '
          f'{plan.num_micro_batches} micro-batch(es) {rc} recompute) and '
          f'the process {size(own)}, but {source or "the memory"} is '
          f'{size(available)}: it may be killed by the OOM killer; ')
  fit = Overrides(profile, plan, task.fprop_dtype, available - own)
  if fit is None:
    return line + ('no override of micro-batches, recompute, schedule or '
                   'bf16 fits; use more memory or more devices.')
  text, fits = fit
  return line + (f'an override that fits (about '
                 f"{size(fits.process_bytes + own)}): "
                 f"--model_params_override='"
                 f"{planner.JoinOverrides(overrides, text)}'.")

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
                overrides: str) -> None:
  """Prints StartWarning's line, if any, to stderr (and the log).

  An experiment the estimate cannot read (a layer without FPropMeta) gets
  no line: the controller's check of the built variables still runs.
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  try:
    # The estimate instantiates the layers: Lingvo's warnings about them
    # belong to the real build, after the trainer's first line.
    with _LingvoQuiet():
      line = StartWarning(model_params, num_cpu_devices, split, overrides)
  except (ValueError, LookupError, AttributeError, NotImplementedError,
          TypeError) as e:
    tf.logging.info('No memory estimate at start: %s', e)
    return
  if line:
    print(line, file=sys.stderr, flush=True)
    tf.logging.warning('%s', line)
