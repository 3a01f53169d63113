"""Checking and simulating a schedule's lists over action costs.

A schedule can be checked for completeness and deadlock (`CheckSchedule`),
simulated (`Simulate`, `CriticalPath`) and printed (`FormatSchedule`) before
any graph is built. Nothing here needs TensorFlow.
"""

import collections
import dataclasses
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional

from lingvo_ext.pipeline.kinds import KINDS
from lingvo_ext.pipeline.kinds import Action
from lingvo_ext.pipeline.kinds import Kind
from lingvo_ext.pipeline.kinds import ScheduleLists
from lingvo_ext.pipeline.kinds import StageSpec
from lingvo_ext.pipeline.runs import WeightGradientRuns


def Deps(spec: StageSpec, a: Action, split: bool) -> List[Action]:
  """The actions `a` needs finished (data dependencies only)."""
  s, t = a.stage, a.micro_batch
  last = spec.num_stages - 1
  grad_kind = Kind.I if split else Kind.B
  if a.kind == 'F':
    return [Action(Kind.F, s - 1, t)] if s else []
  if a.kind == 'R':
    deps = [Action(Kind.F, s, t)]
    if s < last:  # Recompute once the gradient arrives, not before.
      deps.append(Action(grad_kind, s + 1, t))
    return deps
  if a.kind in ('B', 'I'):
    deps = [Action(Kind.R if spec.recompute else Kind.F, s, t)]
    if s < last:
      deps.append(Action(grad_kind, s + 1, t))
    return deps
  if a.kind == 'W':
    return [Action(Kind.I, s, t)]
  raise ValueError('unknown action kind %r' % (a.kind,))


def CheckSchedule(spec: StageSpec, schedule: ScheduleLists) -> None:
  """Raises ValueError unless `schedule` is complete, placed and deadlock-free.

  Complete: every stage's 'F' and either 'B' or both 'I' and 'W' (and 'R'
  with recompute) for every micro-batch, each exactly once. Placed: each on
  its stage's device. Deadlock-free: `Simulate` finishes.

  Args:
    spec: The pipeline.
    schedule: Per device, its ordered actions.
  """
  if len(schedule) != spec.num_devices:
    raise ValueError('schedule has %d device lists for %d devices.' %
                     (len(schedule), spec.num_devices))
  seen = collections.Counter()
  for d, actions in enumerate(schedule):
    for a in actions:
      if a.kind not in KINDS:
        raise ValueError('unknown action %s on device %d.' % (a, d))
      if spec.Device(a.stage) != d:
        raise ValueError('%s on device %d; stage %d runs on device %d.' %
                         (a, d, a.stage, spec.Device(a.stage)))
      seen[a] += 1
  twice = sorted(str(a) for a, n in seen.items() if n > 1)
  if twice:
    raise ValueError('actions scheduled more than once: %s' % ' '.join(twice))
  split = any(a.kind in ('I', 'W') for a in seen)
  kinds = [Kind.F] + ([Kind.R] if spec.recompute else []) + (
      [Kind.I, Kind.W] if split else [Kind.B])
  want = {Action(kind, s, t) for kind in kinds
          for s in range(spec.num_stages)
          for t in range(spec.num_micro_batches)}
  missing = sorted(str(a) for a in want - set(seen))
  extra = sorted(str(a) for a in set(seen) - want)
  if missing or extra:
    raise ValueError('schedule is not complete: missing %s; unexpected %s' %
                     (' '.join(missing) or 'none', ' '.join(extra) or 'none'))
  Simulate(spec, schedule)


def UnitCost(action: Action) -> float:
  """Costs relative to a forward pass: backward 2 (input 1, weights 1)."""
  return {'F': 1., 'R': 1., 'B': 2., 'I': 1., 'W': 1.}[action.kind]


@dataclasses.dataclass
class Timeline:
  """Simulated start and end of every action.

  Attributes:
    spec: The pipeline.
    schedule: Per device, its ordered actions.
    start: Action -> start time.
    end: Action -> end time.
    makespan: When the last action ends.
  """
  spec: StageSpec
  schedule: ScheduleLists
  start: Dict[Action, float]
  end: Dict[Action, float]
  makespan: float

  def IdleFraction(self) -> float:
    """The share of device time not spent in actions (the bubble)."""
    busy = sum(self.end[a] - self.start[a] for a in self.start)
    total = self.makespan * self.spec.num_devices
    return 1. - busy / total if total else 0.

  def PeakInFlight(self, device: int) -> int:
    """Most micro-batch stages with activations held at once on `device`.

    A stage's activations of a micro-batch live from its 'F' to its 'B' (or
    'W', which still reads them); with recompute, only between 'R' and 'B'/'W'
    (the boundary input kept from 'F' is not counted).
    """
    events = []
    for a in self.schedule[device]:
      if a.kind == ('R' if self.spec.recompute else 'F'):
        events.append((self.start[a], 1))
      elif a.kind in ('B', 'W'):
        events.append((self.end[a], -1))
    live = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
      live += delta
      peak = max(peak, live)
    return peak


def Simulate(spec: StageSpec, schedule: ScheduleLists,
             cost: Optional[Callable[[Action], float]] = None) -> Timeline:
  """Runs the schedule on its devices over action costs.

  Each device runs its list in order; an action starts once its device is
  free and the actions it depends on (the previous stage's forward pass,
  the next stage's backward pass, its own forward pass) have ended. Transfers
  between devices take no time.

  Args:
    spec: The pipeline.
    schedule: Per device, its ordered actions.
    cost: Action -> duration (default `UnitCost`).

  Returns:
    The Timeline.

  Raises:
    ValueError: the schedule deadlocks (names what each device waits for).
  """
  cost = cost or UnitCost
  split = any(a.kind in ('I', 'W') for acts in schedule for a in acts)
  pos = [0] * len(schedule)
  free = [0.] * len(schedule)
  start, end = {}, {}
  remaining = sum(len(acts) for acts in schedule)
  while remaining:
    progressed = False
    for d, acts in enumerate(schedule):
      while pos[d] < len(acts):
        a = acts[pos[d]]
        deps = Deps(spec, a, split)
        if any(dep not in end for dep in deps):
          break
        start[a] = max([free[d]] + [end[dep] for dep in deps])
        end[a] = start[a] + cost(a)
        free[d] = end[a]
        pos[d] += 1
        remaining -= 1
        progressed = True
    if not progressed:
      waits = []
      for d, acts in enumerate(schedule):
        if pos[d] < len(acts):
          a = acts[pos[d]]
          need = [str(x) for x in Deps(spec, a, split) if x not in end]
          waits.append('device %d at %s waits for %s' %
                       (d, a, ', '.join(need)))
      raise ValueError('schedule deadlocks: %s' % '; '.join(waits))
  return Timeline(spec, schedule, start, end, max(end.values(), default=0.))


def CriticalPath(spec: StageSpec, schedule: ScheduleLists,
                 cost: Optional[Callable[[Action], float]] = None) -> float:
  """The longest chain of data dependencies over action costs.

  How long the schedule takes where nothing enforces its lists' order
  (TensorFlow's executor on actions no gate holds): an action starts once its
  inputs are ready, whatever else its device runs; how many run at once is
  the caller's to bound. A run of 'W' actions (`WeightGradientRuns`) is one
  MatMul over its micro-batches: it starts once all of the run's input
  gradients have ended.

  Args:
    spec: The pipeline.
    schedule: Per device, its actions.
    cost: Action -> duration (default `UnitCost`).

  Raises:
    ValueError: an action depends on one the lists do not hold.
  """
  cost = cost or UnitCost
  split = any(a.kind in ('I', 'W') for acts in schedule for a in acts)
  deps = {}
  for run in WeightGradientRuns(schedule):
    inputs = [d for w in run for d in Deps(spec, w, split)]
    for i, w in enumerate(run):
      deps[w] = inputs + run[i - 1:i]
  pending = [a for acts in schedule for a in acts]
  end = {}
  while pending:
    rest = []
    for a in pending:
      needs = deps[a] if a in deps else Deps(spec, a, split)
      if all(d in end for d in needs):
        end[a] = max([end[d] for d in needs], default=0.) + cost(a)
      else:
        rest.append(a)
    if len(rest) == len(pending):
      raise ValueError('actions without their inputs: %s' %
                       ', '.join(str(a) for a in rest[:4]))
    pending = rest
  return max(end.values(), default=0.)


def FormatSchedule(spec: StageSpec, schedule: ScheduleLists,
                   cost: Optional[Callable[[Action], float]] = None) -> str:
  """The simulated timeline as text: a row per device, a column per time unit.

  Each action fills the columns it runs in with its label ('F1.3' is stage 1's
  forward pass of micro-batch 3); idle time is '.'.

  Args:
    spec: The pipeline.
    schedule: Per device, its ordered actions.
    cost: Action -> integer duration (default `UnitCost`).

  Returns:
    The table, with the idle fraction in its last line.
  """
  tl = Simulate(spec, schedule, cost)
  width = max([len(str(a)) for acts in schedule for a in acts] + [1])
  cols = int(round(tl.makespan))
  lines = []
  for d, acts in enumerate(schedule):
    row = ['.' * width] * cols
    for a in acts:
      for c in range(int(round(tl.start[a])), int(round(tl.end[a]))):
        row[c] = str(a).ljust(width)
    lines.append('dev%d | %s' % (d, ' '.join(row)))
  lines.append('idle %.1f%% of %d device-steps' %
               (100 * tl.IdleFraction(), cols * spec.num_devices))
  return '\n'.join(lines)

