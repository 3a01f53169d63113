"""The machine fitted to timed runs of pipelines that come cut (the tree path).

A PipelinedTask is calibrated on one-cell reference plans of its layer
stack (calibration.ReferencePlans); a pipeline in Lingvo's task code (e.g.
`task.lm.stack` of GPipeTransformerLm, or an encoder-decoder stack) keeps
its cells as cut, so its references keep them too: all its cells on one
device, 'unrolled' at M=1 and at the larger M, and, where the builder takes
them, 'recurrent' at M=4 (with recompute) and M=1. Each is built as the
trainer builds the task, at the run's shapes, and timed in turn
(measuring.RoundRobin); calibration.Calibrate fits the machine to them. The
task's ops outside the pipeline (embedding, softmax, loss, input) land in
the fitted fixed time of a step. With several pipelines, the first is
calibrated with the others at their own plans. The fitted machine is cached
(machine_cache.py).
"""

import dataclasses
from typing import List
from typing import Optional
from typing import Sequence

from lingvo_ext.pipeline import records
from lingvo_ext.planner import calibration
from lingvo_ext.planner import machine_cache
from lingvo_ext.planner.model_profile import Machine
from lingvo_ext.planner.plans import Divisors
from lingvo_ext.planner.plans import Plan


def ReferencePlans(pipe) -> List[Plan]:
  """The plans timed for pipeline `pipe` (a tree.TreePipeline), as above."""
  profile = pipe.profile
  k, batch = len(profile.layers), profile.batch
  m, m_unrolled = max(Divisors(batch, 4)), max(Divisors(batch, 8))
  out = []
  for schedule, mb, rc in (('unrolled', 1, False),
                           ('unrolled', m_unrolled, False),
                           (records.LINGVO_ENGINE, m, True),
                           (records.LINGVO_ENGINE, 1, True)):
    plan = Plan(num_cells=k, sizes=(1,) * k, devices_per_replica=1,
                num_micro_batches=mb, schedule=schedule, recompute=rc,
                replicas=1, gradient_sync='shared', global_batch=batch)
    if records.Refusal(plan.schedule, k, 1, mb,
                       static_shapes=pipe.length is None):
      break  # Calibrate takes the first 2, 3 or 4.
    out.append(plan)
  return out


def _Apply(pipes):
  """apply(params, plan) of tf_profiling.BuildExperimentStep: the plan on
  the first pipeline (the others keep their own)."""
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  return lambda params, plan: tree.ApplyTree(params, [(pipes[0], plan)])


def TimeReferences(model: str, model_params, pipes, refs: Sequence[Plan],
                   rounds: Optional[int] = None) -> List[float]:
  """The steady step seconds of each reference (measuring.Steady), timed
  in turn (TF)."""
  from lingvo_ext.planner import measuring  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tf_profiling  # pylint: disable=g-import-not-at-top
  steps = [tf_profiling.BuildExperimentStep(
      model, ref, model_params=model_params, apply=_Apply(pipes))
           for ref in refs]
  try:
    times = measuring.RoundRobin(
        [lambda s=s: s[0].run(s[1]) for s in steps],
        rounds or measuring.MEASURE_STEPS, 1)
  finally:
    for sess, _ in steps:
      sess.close()
  return [measuring.Steady(t) for t in times]


def Calibrate(model: str, model_params, pipes, devices: int,
              recalibrate: bool = False,
              machine: Optional[Machine] = None,
              overhead_bytes: float = 0., on_calibrate=None) -> Machine:
  """This host's machine fitted to `pipes[0]`'s references (cached; TF).

  Args:
    model: The experiment's name.
    model_params: Its params as the run builds them (overrides applied).
    pipes: tree.ProfileTree's pipelines.
    devices: The devices the run plans for.
    recalibrate: Time them again even if cached.
    machine: The probed machine (default: probed here, under the trainer's
      session config).
    overhead_bytes: The probed machine's Machine.overhead_bytes.
    on_calibrate: Called before the references are timed (a cache miss).
  """
  from lingvo_ext.planner import tf_profiling  # pylint: disable=g-import-not-at-top
  pipe = pipes[0]
  refs = ReferencePlans(pipe)
  key = machine_cache.Key(pipe.profile, devices, refs, 'tree %d\n%s' % (
      overhead_bytes, machine_cache.Host()))

  def Fit():
    if on_calibrate:
      on_calibrate()
    probed = machine or tf_profiling.ProbeMachine(
        tf_profiling.SessionConfig(devices),
        overhead_bytes=overhead_bytes)
    times = TimeReferences(model, model_params, pipes, refs)
    return calibration.Calibrate(pipe.profile, probed, times, refs=refs)

  return machine_cache.Cached(key, Fit, recalibrate)


def Described(machine: Machine) -> str:
  """The fitted constants, for a log line."""
  return ', '.join('%s=%.3g' % (f.name, getattr(machine, f.name))
                   for f in dataclasses.fields(machine)
                   if f.name in ('flops_per_s', 's_per_op', 'step_s',
                                 'recurrent_op_factor'))
