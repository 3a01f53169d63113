"""Transforms of a schedule's lists: split, fold, reorder.

Nothing here needs TensorFlow.
"""

import collections

from lingvo_ext.pipeline.kinds import Action
from lingvo_ext.pipeline.kinds import Kind
from lingvo_ext.pipeline.kinds import ScheduleLists
from lingvo_ext.pipeline.kinds import StageSpec
from lingvo_ext.pipeline.simulate import Simulate


def GroupWeightGradients(schedule: ScheduleLists,
                         group: int) -> ScheduleLists:
  """`schedule` with each 'B' split into 'I' and a deferred 'W', the 'W's of
  each stage in runs of `group` micro-batches.

  A stage's run of `group` 'W's comes right after the 'I' that completes it
  (the last group may be shorter), so the engine computes a weight's gradient
  as one MatMul per group rather than one weight-sized gradient per
  micro-batch added to a running sum; a group's weight-gradient operands stay
  alive until its run. group=1 splits each 'B' in place.

  Args:
    schedule: Per device, its ordered actions.
    group: Micro-batches per run of 'W's, >= 1.

  Returns:
    Per device, its ordered actions.
  """
  if group < 1:
    raise ValueError('group=%r must be >= 1.' % (group,))
  out = []
  for acts in schedule:
    pending = collections.defaultdict(list)
    new = []
    for a in acts:
      if a.kind != 'B':
        new.append(a)
        continue
      new.append(Action(Kind.I, a.stage, a.micro_batch))
      pending[a.stage].append(a.micro_batch)
      if len(pending[a.stage]) == group:
        new += [Action(Kind.W, a.stage, t) for t in pending.pop(a.stage)]
    for stage, ts in pending.items():
      new += [Action(Kind.W, stage, t) for t in ts]
    out.append(new)
  return out


def FoldOntoDevices(virtual: StageSpec, schedule: ScheduleLists,
                    spec: StageSpec) -> ScheduleLists:
  """A schedule for `virtual`'s devices, run on `spec`'s fewer devices.

  Each of `spec`'s devices runs the actions of its stages in the order of
  their start times when `schedule` is simulated on `virtual` (unit costs).
  Deadlock-free: an action's dependencies start strictly before it does, so
  no device waits for an action that comes after it in another's list.

  Args:
    virtual: The pipeline with one device per stage.
    schedule: Per virtual device, its ordered actions.
    spec: The same pipeline on fewer devices (stage s on s % num_devices).

  Returns:
    Per device of `spec`, its ordered actions.
  """
  timeline = Simulate(virtual, schedule)
  out = [[] for _ in range(spec.num_devices)]
  for acts in schedule:
    for a in acts:
      out[spec.Device(a.stage)].append(a)
  for acts in out:
    acts.sort(key=lambda a: (timeline.start[a], a.stage))
  return out


def ForwardsFirst(schedule: ScheduleLists) -> ScheduleLists:
  """`schedule` with each device's 'F' actions ahead of its other actions.

  For a loss that is not linear in the pipeline's outputs (e.g. a softmax
  cross-entropy computed after the last cell), no output gradient exists
  before every micro-batch's forward pass has run, so a backward action
  cannot come between forward actions. Each device keeps the order of its
  forward actions and of its backward actions; the backward actions (and
  a split schedule's deferred 'W's) keep their schedule's order, and all
  activations are alive at once, as under GPipe.

  Args:
    schedule: Per device, its ordered actions.

  Returns:
    Per device, its forward actions and then its other actions.
  """
  return [[a for a in acts if a.kind == 'F'] +
          [a for a in acts if a.kind != 'F'] for acts in schedule]

