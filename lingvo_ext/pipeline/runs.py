"""Reading a schedule's lists: runs of weight gradients, what waits for what.

The engine and the planner read the lists the same way through these.
"""

from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

from lingvo_ext.pipeline.kinds import Action
from lingvo_ext.pipeline.kinds import Kind
from lingvo_ext.pipeline.kinds import ScheduleLists


def WeightGradientRunLength(weights: float, operands: float,
                            num_micro_batches: int) -> int:
  """A run of weight gradients (`StageSpec.weight_gradient_run`: GPipe's
  with recompute, 1F1B's), from the weights' size and the MatMul operands (x
  and dy) one micro-batch keeps for them.

  A run of r keeps r - 1 more micro-batches' operands alive and saves r - 1
  weight-sized gradients and their adds: runs are as long as the operands
  they keep stay within one copy of the weights, 1 + weights // operands,
  at most M (M where operands cost nothing; 1 where there are no weights to
  batch).
  """
  if not weights:
    return 1
  if not operands:
    return num_micro_batches
  return min(num_micro_batches, 1 + int(weights // operands))


def WeightGradientRuns(schedule: ScheduleLists) -> List[List[Action]]:
  """The maximal runs of consecutive 'W' actions of one stage on a device.

  An engine computes each run as one batched weight gradient: one MatMul per
  weight over the rows of all the run's micro-batches, rather than one
  weight-sized gradient per micro-batch summed afterwards.

  Args:
    schedule: Per device, its ordered actions.

  Returns:
    The runs, each in its device's order, devices in order.
  """
  runs = []
  for acts in schedule:
    run = []
    for a in acts:
      if a.kind == Kind.W and run and run[-1].stage == a.stage:
        run.append(a)
        continue
      if run:
        runs.append(run)
      run = [a] if a.kind == Kind.W else []
    if run:
      runs.append(run)
  return runs


def Waits(schedule: ScheduleLists,
          kinds: Sequence[str]) -> Dict[Action, List[Action]]:
  """What each action of `kinds` waits for: every action on its device since
  the previous action of `kinds` (that one included).

  So an action of `kinds` runs after every action before it on its device
  has, even where those are not held in order themselves. The 'W's of a
  run (`WeightGradientRuns`) are one action: only its first waits.

  Args:
    schedule: Per device, its ordered actions.
    kinds: The kinds whose place is enforced (`ORDERED_KINDS`).

  Returns:
    Action of `kinds` -> the actions it waits for, in order.
  """
  run_of = {a: tuple(run) for run in WeightGradientRuns(schedule)
            for a in run}
  waits = {}
  for acts in schedule:
    since = []
    for a in acts:
      in_run = bool(since) and a in run_of and run_of.get(since[-1]) == run_of[a]
      if a.kind in kinds and not in_run:
        waits[a] = since
        since = [a]
      else:
        since.append(a)
  return waits


def PreviousOnDevice(schedule: ScheduleLists,
                     kinds: Sequence[str]) -> Dict[Action, Optional[Action]]:
  """For each action, the last action of one of `kinds` before it on its
  device (None if there is none): what an engine orders it after."""
  out = {}
  for acts in schedule:
    last = None
    for a in acts:
      out[a] = last
      if a.kind in kinds:
        last = a
  return out
