"""The best plan for a registered experiment: chosen, applied, described.

The trainer's `--plan=auto` (`TrainerAutoPlan`) and `lingvo_ext.tools.plan`
profile the experiment, probe (and calibrate) this host, rank the plans and
apply the best to the params. An experiment whose pipelines come cut (not a
PipelinedTask) is planned per pipeline (`tree`).
"""

import dataclasses
from typing import Dict
from typing import List
from typing import Optional

from lingvo_ext import planner
from lingvo_ext.planner import machine_cache
from lingvo_ext.planner import measuring
from lingvo_ext.planner import tree
from lingvo_ext.planner import tree_calibration
from lingvo_ext.tasks import pipeline_tree

# Process memory besides the model, only for the process totals printed
# (the budget is per device, without it): what bench/plan.py's calibration
# found for lm.TransformerLmTiny on the development machine (its M=1
# reference's peak RSS less the predicted model and graph bytes; see
# docs/benchmarks.md, "Planner").
PROCESS_OVERHEAD_BYTES = 730 * 2**20


def Machine(num_devices: int, model: Optional[str] = None,
            profile: Optional[planner.ModelProfile] = None,
            overhead_bytes: float = PROCESS_OVERHEAD_BYTES,
            overrides: str = '', model_params=None, xla: bool = False,
            recalibrate: bool = False, on_calibrate=None):
  """This host's Machine, probed under the trainer's session config.

  With `model` and `profile`, calibrated (planner.Calibrate) on the model's
  reference plans (after `overrides`, a --model_params_override text; or on
  copies of `model_params`, built with it), timed in turn in this process;
  with `xla` too, XLA's costs on its XLA references (planner.CalibrateXla),
  unless XLA cannot compile the model's cells (then they stay unset, logged).
  A calibration is cached (machine_cache.py); `recalibrate` times it again.
  `on_calibrate()` is called before the references are timed (a cache miss).
  """
  if model and profile:
    refs = planner.ReferencePlans(profile, devices=num_devices)
    key = machine_cache.Key(profile, num_devices, refs, '%s\nxla=%s %d' % (
        machine_cache.Host(), xla, overhead_bytes))

    def Fit():
      if on_calibrate:
        on_calibrate()
      return _Calibrated(num_devices, model, profile, overhead_bytes,
                         overrides, model_params, xla, refs)

    return machine_cache.Cached(key, Fit, recalibrate)
  return planner.ProbeMachine(planner.SessionConfig(num_devices),
                              overhead_bytes=overhead_bytes)


def _Calibrated(num_devices, model, profile, overhead_bytes, overrides,
                model_params, xla, refs):
  """Machine's calibration, timed now."""
  machine = planner.ProbeMachine(planner.SessionConfig(num_devices),
                                 overhead_bytes=overhead_bytes)
  steps = [planner.BuildExperimentStep(model, ref, overrides, model_params)
           for ref in refs]
  xla_refs = (_XlaSteps(model, profile, num_devices, overrides,
                        model_params) if xla else [])
  timed = steps + [s for _, s in xla_refs]
  times = measuring.RoundRobin(
      [lambda s=s: s[0].run(s[1]) for s in timed], measuring.MEASURE_STEPS, 1)
  for sess, _ in timed:
    sess.close()
  best = [measuring.Steady(t) for t in times]
  machine = planner.Calibrate(profile, machine, best[:len(steps)], refs=refs)
  if xla_refs:
    machine = planner.CalibrateXla(profile, machine, best[len(steps):],
                                   [ref for ref, _ in xla_refs])
  return machine


def _XlaSteps(model, profile, num_devices, overrides, model_params):
  """[(plan, (session, train op))] of the XLA references, each run once (XLA
  compiles); [] where XLA cannot compile the cells."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  from lingvo_ext.core import jit_choice  # pylint: disable=g-import-not-at-top
  out = []
  try:
    for ref in planner.XlaReferencePlans(profile, devices=num_devices):
      sess, step = planner.BuildExperimentStep(model, ref, overrides,
                                               model_params)
      out.append((ref, (sess, step)))
      sess.run(step)
  except tf.errors.OpError as e:
    for _, (sess, _) in out:
      sess.close()
    cause = jit_choice.CannotRunCause(e)
    if cause is None:
      raise
    tf.logging.warning('planner: XLA cannot compile the cells of %s (%s); '
                       'plans with XLA are not offered.', model, cause)
    return []
  return out


def ChooseForExperiment(model_params, name: str, devices: int,
                        memory_per_device: Optional[float] = None,
                        global_batch: Optional[int] = None,
                        machine: Optional[planner.Machine] = None,
                        calibrate: bool = True,
                        overrides: str = '',
                        xla: bool = False,
                        recalibrate: bool = False) -> List[planner.Candidate]:
  """Ranked predicted plans of an experiment's params (PlanError if none).

  Without `machine`, this host's, probed, and with `calibrate` calibrated on
  the experiment `name`'s reference plans (see Machine), `overrides` (the
  --model_params_override that made `model_params`) applied to them. With
  `xla`, each plan with jit_compile False and True (XLA calibrated too),
  else 'auto', left to the timing when the model is built.
  """
  profile = planner.ProfileExperiment(model_params, name)
  machine = machine or Machine(devices, name if calibrate else None, profile,
                               overrides=overrides, model_params=model_params,
                               xla=xla, recalibrate=recalibrate)
  jit_choices = ('auto',)
  if xla:
    # Calibrated without XLA's costs: XLA cannot compile the cells.
    cannot = calibrate and machine.xla_s_per_call is None
    jit_choices = (False,) if cannot else (False, True)
  return planner.Choose(profile, devices, memory_per_device, global_batch,
                        machine, jit_choices=jit_choices)


def Fitting(profile, ranked, constants, available: Optional[float],
            source: str = '', rest: float = 0.):
  """The ranked candidates whose predicted peak RSS (memory_model, plus
  `rest` bytes of the process's other pipelines) is within `available`.

  Raises:
    ValueError: none fits (one line: the least need and the memory).
  """
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  if available is None:
    return list(ranked)
  needs = [memory_model.Predict(profile, c.plan, constants).rss_bytes + rest
           for c in ranked]
  out = [c for c, need in zip(ranked, needs) if need <= available]
  if not out:
    size = planner.FormatSize
    raise ValueError(
        f'--plan=auto: no plan fits in {source or "the memory"} '
        f'({size(available)}): the least needs about {size(min(needs))} of '
        'peak RSS; run on more memory or more --devices, or with bf16 '
        '(task.fprop_dtype).')
  return out


def ChooseAndApply(model_params, name: str, devices: int,
                   memory_per_device: Optional[float] = None,
                   global_batch: Optional[int] = None,
                   machine: Optional[planner.Machine] = None,
                   overrides: str = '', available: Optional[float] = None,
                   constants=None, source: str = '', rest: float = 0.):
  """Picks the best predicted plan and sets it on `model_params`: the best
  whose predicted peak RSS, plus `rest` bytes no plan changes (the input's
  record buffer), fits in `available` bytes (with `constants`,
  memory_model.Constants), if given.

  Returns:
    (the plan, the trainer flags it needs: --num_cpu_devices and
    --worker_split_size as a dict).
  """
  ranked = ChooseForExperiment(model_params, name, devices,
                               memory_per_device, global_batch, machine,
                               overrides=overrides)
  if available is not None:
    ranked = Fitting(planner.ProfileExperiment(model_params, name), ranked,
                     constants, available, source, rest)
  plan = ranked[0]
  planner.ApplyPlan(model_params, plan)
  return plan, dict(num_cpu_devices=plan.devices,
                    worker_split_size=plan.devices_per_replica)


def ChooseTreeForExperiment(model_params, name: str, devices: int,
                            memory_per_device: Optional[float] = None,
                            machine: Optional[planner.Machine] = None,
                            calibrate: bool = True,
                            recalibrate: bool = False):
  """Each pipeline of a non-PipelinedTask experiment with its ranked plans.

  Its cells as cut, one replica (planner.tree); without `machine`, this
  host's, probed and with `calibrate` calibrated on the first pipeline's
  references (planner/tree_calibration.py, cached; `recalibrate` times them
  again).
  """
  # A time-major Lingvo LM feeding a batch-major pipeline: its one line, not
  # the shape error profiling would meet.
  pipeline_tree.CheckTimeMajorLm(model_params.task)
  pipes = tree.ProfileTree(model_params, name)
  if machine is None and calibrate:
    machine = tree_calibration.Calibrate(
        name, model_params, pipes, devices, recalibrate,
        overhead_bytes=PROCESS_OVERHEAD_BYTES)
  machine = machine or planner.ProbeMachine(
      planner.SessionConfig(devices), overhead_bytes=PROCESS_OVERHEAD_BYTES)
  return tree.ChooseTree(pipes, devices, memory_per_device, machine)


def TreeFlags(chosen) -> Dict[str, int]:
  """The trainer flags the pipelines' chosen plans need (one replica)."""
  devices = chosen[0][1].devices_per_replica
  return dict(num_cpu_devices=devices, worker_split_size=devices)


def TreeCommand(model: str, chosen, overrides: str = '') -> str:
  """The trainer command line that runs the pipelines' chosen plans (after
  `overrides`, the user's --model_params_override)."""
  flags = ' '.join('--%s=%d' % kv for kv in TreeFlags(chosen).items())
  return (".venv/bin/python -m lingvo_ext.trainer --model=%s %s "
          "--model_params_override='%s' --logdir=LOGDIR" %
          (model, flags, planner.JoinOverrides(
              overrides, tree.TreeOverrideString(chosen))))


def _FittingTree(ranked, constants, available, source, rest: float = 0.):
  """[(pipeline, plan)]: each pipeline's best plan on the first's devices
  whose peak RSS, with the other pipelines' chosen so far (the later ones
  at their best) and `rest` bytes no plan changes, fits (memory_model; the
  runtime counted once)."""
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  chosen = [(pipe, plans[0]) for pipe, plans in ranked]
  if available is None:
    return chosen
  for i, (pipe, plans) in enumerate(ranked):
    d = chosen[0][1].devices_per_replica
    others = rest + sum(
        memory_model.Predict(p.profile, c.plan, constants).rss_bytes -
        constants.runtime_bytes for j, (p, c) in enumerate(chosen) if j != i)
    same = [c for c in plans if c.devices_per_replica == d or i == 0]
    chosen[i] = (pipe, Fitting(pipe.profile, same, constants, available,
                               source, others)[0])
  return chosen


@dataclasses.dataclass
class AutoPlan:
  """What --plan=auto chose, applied to a copy of the trainer's params."""
  # The params with the plan set (typed, no text parsed back).
  params: object
  # A Candidate; for an experiment whose pipelines come cut, [(pipeline,
  # Candidate)].
  plan: object
  # --model_params_override: the user's, then the plan's. The reproducible
  # record: GetParams with it builds `params` again.
  override: str
  # The trainer flags the plan needs: {'num_cpu_devices': N, ...}.
  flags: Dict[str, int]
  # One line to log: the plan, its figures, how to run it again.
  line: str


def _CheckFlags(devices: int, memory_per_device: Optional[str],
                gpipe_engine: str) -> Optional[float]:
  """The budget in bytes (or None); ValueError naming a bad flag."""
  if devices < 1:
    raise ValueError('--devices=%d must be >= 1; pass the number of devices '
                     'to plan for, e.g. --devices=2.' % devices)
  budget = None
  if memory_per_device:
    try:
      budget = planner.ParseSize(memory_per_device)
    except ValueError as e:
      raise ValueError('--memory_per_device=%s: %s' %
                       (memory_per_device, e)) from None
  if gpipe_engine != 'lingvo_ext':
    raise ValueError(f'--plan=auto plans lingvo_ext\'s engine, not '
                     f'--gpipe_engine={gpipe_engine}; pass '
                     '--gpipe_engine=lingvo_ext or leave --plan out.')
  return budget


def PlanParams(model_params, model: str, devices: int,
               memory_per_device: Optional[str] = None,
               overrides: str = '', gpipe_engine: str = 'lingvo_ext',
               machine: Optional[planner.Machine] = None,
               available=None, constants=None) -> AutoPlan:
  """The trainer's --plan=auto on the params it built: the best plan whose
  predicted peak RSS (planner/memory_model.py) fits in the memory this
  process may use.

  Args:
    model_params: The experiment's params as the trainer built them (with
      `overrides`); left unchanged: the plan is set on a copy.
    model: The registered experiment (--model), for messages and commands.
    devices: --devices.
    memory_per_device: --memory_per_device text, or None.
    overrides: The user's --model_params_override that `model_params` holds.
    gpipe_engine: --gpipe_engine; the planner plans lingvo_ext's.
    machine: The machine to plan for (default: this host's, probed and, for
      a PipelinedTask, calibrated on copies of `model_params`).
    available: The bytes the process may use (default: the cgroup's limit,
      else the machine's available memory: task_health.AvailableBytes).
    constants: memory_model.Constants (default: this machine's,
      memory_probe.Get).

  Raises:
    ValueError: a one-line message naming the flag (a bad size, or no plan
      fits the budget).
  """
  from lingvo_ext.distributed import task_health  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import input_memory  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  budget = _CheckFlags(devices, memory_per_device, gpipe_engine)
  cfg = model_params.Copy()
  refusal = pipeline_tree.PlannerRefusal(cfg, model)
  if refusal:
    raise ValueError('--plan=auto: ' + refusal)
  source = 'the memory'
  if available is None:
    available, source = task_health.AvailableBytes()
  if available is not None and constants is None:
    constants = memory_probe.Get(devices)
  # As the start check counts it: the same for every plan.
  buffered = input_memory.RunBufferBytes(cfg)
  if pipeline_tree.IsCut(cfg):
    ranked = ChooseTreeForExperiment(cfg, model, devices, budget, machine)
    if available is not None:
      # The task outside its pipelines: the same under every plan of theirs.
      from lingvo_ext.planner import tree_memory  # pylint: disable=g-import-not-at-top
      buffered += sum(tree_memory.OtherTerms(
          tree_memory.ProfileTaskMemory(cfg, model),
          constants.bytes_per_op).values())
    chosen = _FittingTree(ranked, constants, available, source, buffered)
    tree.ApplyTree(cfg, chosen)
    text = tree.TreeOverrideString(chosen)
    flags = TreeFlags(chosen)
    described = '; '.join(
        '%s %s%s' % (pipe.path, planner.Describe(plan),
                     ' (sized for %s)' % pipe.length.Describe()
                     if pipe.length else '')
        for pipe, plan in chosen)
    flag_text = ' '.join('--%s=%d' % kv for kv in flags.items())
    plan = chosen
  else:
    plan, flags = ChooseAndApply(cfg, model, devices, budget, machine=machine,
                                 overrides=overrides, available=available,
                                 constants=constants, source=source,
                                 rest=buffered)
    text = planner.OverrideString(plan)
    described = planner.Describe(plan)
    flag_text = ' '.join(planner.TrainerFlags(plan))
  text = planner.JoinOverrides(overrides, text)
  line = ('--plan=auto chose %s; running it with %s '
          "--model_params_override='%s'" % (described, flag_text, text))
  return AutoPlan(cfg, plan, text, flags, line)


def TrainerAutoPlan(model: str, devices: int,
                    memory_per_device: Optional[str] = None,
                    overrides: str = '', gpipe_engine: str = 'lingvo_ext'):
  """--plan=auto from the experiment's name: its params built, PlanParams.

  Returns:
    (the plan (for an experiment other than a PipelinedTask: [(pipeline,
    plan)]), its --model_params_override text, the trainer flags it needs as
    a dict, one line to log).

  Raises:
    ValueError: as PlanParams.
  """
  _CheckFlags(devices, memory_per_device, gpipe_engine)  # Before building.
  chosen = PlanParams(planner.ExperimentParams(model, overrides=overrides),
                      model, devices, memory_per_device, overrides,
                      gpipe_engine)
  return chosen.plan, chosen.override, chosen.flags, chosen.line
