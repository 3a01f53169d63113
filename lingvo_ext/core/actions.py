"""Pipeline schedules as data: the ordered actions of each device.

A schedule here is a pure-Python function of a small stage description
(`StageSpec`) that returns, for every device, the list of actions it runs in
order, as torch.distributed.pipelining's `_Action` lists and DeepSpeed's
`PipeSchedule.steps()` do. Nothing here needs TensorFlow: a schedule can be
printed (`FormatSchedule`), checked for completeness and deadlock
(`CheckSchedule`) and simulated over action costs (`Simulate`) before any graph
is built, and tested as exact lists.

An action is (kind, stage, micro_batch):

- 'F': the stage's forward pass of the micro-batch.
- 'R': its forward pass recomputed in the backward pass (re-materialisation).
- 'B': its backward pass: input and weight gradients.
- 'I': the input gradients alone; 'W': the weight gradients alone (a backward
  pass split in two, as zero-bubble schedules do).

Stage s runs on device s % num_devices: with more stages than devices each
device holds several (virtual) stages, round robin, as Megatron's
interleaved schedule and `PipeliningLayer` place them.
"""

import collections
import dataclasses
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence


class Action(NamedTuple):
  """One step of one device: `kind` of stage `stage` on `micro_batch`."""
  kind: str
  stage: int
  micro_batch: int

  def __str__(self):
    return '%s%d.%d' % (self.kind, self.stage, self.micro_batch)


KINDS = ('F', 'R', 'B', 'I', 'W')


@dataclasses.dataclass(frozen=True)
class StageSpec:
  """What a schedule needs to know of a pipeline.

  Attributes:
    num_stages: Pipeline stages (cells), K.
    num_devices: Devices they run on; stage s on device s % num_devices.
    num_micro_batches: Micro-batches, M.
    recompute: Whether each stage's forward pass is recomputed ('R') before
      its backward pass.
    weight_gradient_run: How many micro-batches' weight gradients a run
      computes at once, where the engine picks it
      (`WeightGradientRunLength`): GPipe ('unrolled') with recompute, one run
      of 'W's after every that many micro-batches' 'R' and 'I', their
      recomputed activations alive until it (1: 'R' and 'B' per
      micro-batch); 1F1B ('1f1b') without recompute, runs of that many
      micro-batches where it is more than K.
  """
  num_stages: int
  num_devices: int
  num_micro_batches: int
  recompute: bool = False
  weight_gradient_run: int = 1

  def __post_init__(self):
    for name in ('num_stages', 'num_devices', 'num_micro_batches',
                 'weight_gradient_run'):
      if getattr(self, name) < 1:
        raise ValueError('StageSpec: %s=%r must be >= 1.' %
                         (name, getattr(self, name)))
    if self.num_devices > self.num_stages:
      raise ValueError(
          'StageSpec: num_devices=%d > num_stages=%d; a device needs a '
          'stage: use at most %d devices.' %
          (self.num_devices, self.num_stages, self.num_stages))

  def Device(self, stage: int) -> int:
    return stage % self.num_devices

  def Stages(self, device: int) -> List[int]:
    return list(range(device, self.num_stages, self.num_devices))


ScheduleLists = List[List[Action]]


def _Backward(spec: StageSpec, stage: int, t: int) -> List[Action]:
  if spec.recompute:
    return [Action('R', stage, t), Action('B', stage, t)]
  return [Action('B', stage, t)]


def GPipe(spec: StageSpec) -> ScheduleLists:
  """All forward passes, then all backward passes (GPipe; 'unrolled').

  Each device runs its stages' forward passes micro-batch by micro-batch,
  then their input gradients ('I') in the same micro-batch order, last stage
  first, then each stage's weight gradients ('W') of every micro-batch: one
  run of 'W' actions per stage, which the engine computes as one MatMul per
  weight over all M micro-batches' rows (`WeightGradientRuns`). With
  recompute, 'R' before each 'I', and a run of 'W's per stage after every
  `spec.weight_gradient_run` micro-batches: a run keeps its micro-batches'
  recomputed activations (the MatMuls' inputs) alive until it runs. A run of
  1 is 'R' and 'B' per micro-batch.
  """
  m, run = spec.num_micro_batches, spec.weight_gradient_run
  out = []
  for d in range(spec.num_devices):
    stages = spec.Stages(d)
    actions = [Action('F', s, t) for t in range(m) for s in stages]
    if spec.recompute and run == 1:
      for t in range(m):
        for s in reversed(stages):
          actions += [Action('R', s, t), Action('B', s, t)]
    elif spec.recompute:
      for first in range(0, m, run):
        group = range(first, min(first + run, m))
        for t in group:
          for s in reversed(stages):
            actions += [Action('R', s, t), Action('I', s, t)]
        for s in reversed(stages):
          actions += [Action('W', s, t) for t in group]
    else:
      for t in range(m):
        actions += [Action('I', s, t) for s in reversed(stages)]
      for s in reversed(stages):
        actions += [Action('W', s, t) for t in range(m)]
    out.append(actions)
  return out


def OneFOneB(spec: StageSpec) -> ScheduleLists:
  """1F1B: after K - d - 1 warm-up forwards, one forward, one backward.

  Device d has at most K - d micro-batches' activations alive. With more
  stages than devices, the one-stage-per-device schedule folded onto the
  devices (`FoldOntoDevices`): stage s keeps its K - s bound.
  """
  if spec.num_stages != spec.num_devices:
    virtual = dataclasses.replace(spec, num_devices=spec.num_stages)
    return FoldOntoDevices(virtual, OneFOneB(virtual), spec)
  k, m = spec.num_stages, spec.num_micro_batches
  out = []
  for d in range(k):
    warmup = min(k - d - 1, m)
    actions = [Action('F', d, t) for t in range(warmup)]
    for j in range(m - warmup):
      actions.append(Action('F', d, warmup + j))
      actions += _Backward(spec, d, j)
    for j in range(m - warmup, m):
      actions += _Backward(spec, d, j)
    out.append(actions)
  return out


def Interleaved1F1B(spec: StageSpec) -> ScheduleLists:
  """Megatron's interleaved 1F1B: V = K / D virtual stages per device.

  Device d holds stages d, d + D, ...; it runs forward passes of micro-batch
  groups of D through its virtual stages in turn (chunk (k // D) % V), so
  the warm-up, and the bubble, shrink by V. Needs K % D == 0 and M % D == 0
  (as Megatron); with V = 1 it is `OneFOneB`.
  """
  k, dev, m = spec.num_stages, spec.num_devices, spec.num_micro_batches
  if k % dev:
    raise ValueError(
        "interleaved_1f1b: %d stages on %d devices; the number of cells must "
        'be a multiple of the number of devices (V cells per device).' %
        (k, dev))
  if m % dev:
    raise ValueError(
        'interleaved_1f1b: num_micro_batches=%d must be a multiple of the '
        'number of devices (%d); use %d.' % (m, dev, max(dev, m // dev * dev)))
  v = k // dev
  if v == 1:
    return OneFOneB(spec)
  total = m * v
  out = []
  for d in range(dev):

    def Fwd(i, d=d):
      chunk = (i // dev) % v
      return Action('F', chunk * dev + d, (i // (dev * v)) * dev + i % dev)

    def Bwd(i, d=d):
      chunk = v - 1 - (i // dev) % v
      return _Backward(spec, chunk * dev + d,
                       (i // (dev * v)) * dev + i % dev)

    warmup = min((dev - d - 1) * 2 + (v - 1) * dev, total)
    actions = [Fwd(i) for i in range(warmup)]
    for i in range(total - warmup):
      actions.append(Fwd(warmup + i))
      actions += Bwd(i)
    for i in range(total - warmup, total):
      actions += Bwd(i)
    out.append(actions)
  return out


def ZeroBubble(spec: StageSpec) -> ScheduleLists:
  """ZB-H1: 1F1B's memory, each backward split into 'I' and a deferred 'W'.

  Input gradients ('I') go upstream as soon as they can, so they reach the
  first stage after K - 1 input-gradient steps rather than K - 1 whole
  backward passes; weight gradients ('W') run when a device would otherwise
  wait. The order is found by running the pipeline over unit costs
  (`UnitCost`) with one rule per free device: an 'I' that is ready, else a
  'F' while fewer than K - d micro-batches hold activations on device d
  (1F1B's bound: a micro-batch's are freed by its 'W'), else the oldest
  pending 'W'.

  With fewer devices than stages, the one-stage-per-device schedule is
  folded onto the devices (`FoldOntoDevices`).
  """
  if spec.num_stages != spec.num_devices:
    virtual = dataclasses.replace(spec, num_devices=spec.num_stages)
    return FoldOntoDevices(virtual, ZeroBubble(virtual), spec)
  k, m = spec.num_stages, spec.num_micro_batches
  out = [[] for _ in range(k)]
  end = {}
  free = [0.] * k
  next_f = [0] * k
  next_i = [0] * k
  pending = [collections.deque() for _ in range(k)]
  remaining = k * m * 3

  def Ready(a):
    deps = _Deps(spec, a, True)
    if spec.recompute and a.kind == 'I':
      deps = [Action('F', a.stage, a.micro_batch)] + deps[1:]
    return all(dep in end for dep in deps), max(
        [end[dep] for dep in deps if dep in end] + [0.])

  while remaining:
    # The device that can start something soonest goes next.
    best = None
    for d in range(k):
      choices = []
      if next_i[d] < next_f[d]:
        a = Action('I', d, next_i[d])
        ok, at = Ready(a)
        if ok:
          choices.append((max(at, free[d]), 0, a))
      if next_f[d] < m and next_f[d] - (next_i[d] - len(pending[d])) < k - d:
        a = Action('F', d, next_f[d])
        ok, at = Ready(a)
        if ok:
          choices.append((max(at, free[d]), 1, a))
      if pending[d]:
        choices.append((free[d], 2, Action('W', d, pending[d][0])))
      if choices:
        t0, rank, a = min(choices)
        # Prefer I, then F, over a W that could start now only if they can
        # start as soon.
        cand = (t0, rank, d, a)
        if best is None or cand < best:
          best = cand
    assert best is not None, 'zero_bubble: no action can run'
    t0, _, d, a = best
    if a.kind == 'F':
      next_f[d] += 1
      out[d].append(a)
    elif a.kind == 'I':
      next_i[d] += 1
      pending[d].append(a.micro_batch)
      if spec.recompute:
        out[d].append(Action('R', d, a.micro_batch))
      out[d].append(a)
    else:
      pending[d].popleft()
      out[d].append(a)
    end[a] = t0 + UnitCost(a) * (2 if spec.recompute and a.kind == 'I'
                                 else 1)
    free[d] = end[a]
    remaining -= 1
  return out


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
      new.append(Action('I', a.stage, a.micro_batch))
      pending[a.stage].append(a.micro_batch)
      if len(pending[a.stage]) == group:
        new += [Action('W', a.stage, t) for t in pending.pop(a.stage)]
    for stage, ts in pending.items():
      new += [Action('W', stage, t) for t in ts]
    out.append(new)
  return out


def OneFOneBGroupedWeights(spec: StageSpec) -> ScheduleLists:
  """1F1B ('1f1b'), its weight gradients in runs of K micro-batches or more.

  `OneFOneB`'s order with each backward pass split into its input gradients
  and a deferred weight gradient (`GroupWeightGradients`): one
  weight-gradient MatMul per run instead of a weight-sized gradient per
  micro-batch summed at the end. A run is K micro-batches, or
  `spec.weight_gradient_run` where that is more (where the weights outweigh
  the MatMul operands a micro-batch keeps for them, longer runs keep a few
  more micro-batches' operands instead of summing weight-sized gradients:
  `WeightGradientRunLength`). Stage s's MatMul operands stay alive until
  their run: at most K - s + run - 1 micro-batches' (K - s + K - 1 for runs
  of K). With recompute, `OneFOneB` itself: one micro-batch's recomputed
  activations at a time, freed by its 'B'.
  """
  if spec.recompute:
    return OneFOneB(spec)
  return GroupWeightGradients(OneFOneB(spec),
                              max(spec.num_stages, spec.weight_gradient_run))


# Schedules by the name PipeliningLayer's `schedule` param gives them.
ACTION_SCHEDULES = {
    'unrolled': GPipe,
    '1f1b': OneFOneBGroupedWeights,
    'interleaved_1f1b': Interleaved1F1B,
    'zero_bubble': ZeroBubble,
}


# The action kinds whose place in its device's list an engine enforces, per
# schedule: such an action waits for the action before it on its device. The
# others run as soon as their data is there, in whatever order TensorFlow's
# executor picks; where devices share cores (CPU devices of one process) a
# core a device leaves idle then runs another's work. GPipe ('unrolled')
# enforces only its recomputations (one micro-batch's recomputed activations
# at a time); its other actions are one order the dataflow allows. 1F1B
# enforces its forward passes and recomputations: forward t waits for the
# action before it in the list, which bounds the micro-batches in flight; its
# backward passes run as their gradients arrive. The list schedules enforce
# every action.
ORDERED_KINDS = {
    'unrolled': ('R',),
    '1f1b': ('F', 'R'),
    'interleaved_1f1b': KINDS,
    'zero_bubble': KINDS,
}


def _Deps(spec: StageSpec, a: Action, split: bool) -> List[Action]:
  """The actions `a` needs finished (data dependencies only)."""
  s, t = a.stage, a.micro_batch
  last = spec.num_stages - 1
  grad_kind = 'I' if split else 'B'
  if a.kind == 'F':
    return [Action('F', s - 1, t)] if s else []
  if a.kind == 'R':
    deps = [Action('F', s, t)]
    if s < last:  # Recompute once the gradient arrives, not before.
      deps.append(Action(grad_kind, s + 1, t))
    return deps
  if a.kind in ('B', 'I'):
    deps = [Action('R' if spec.recompute else 'F', s, t)]
    if s < last:
      deps.append(Action(grad_kind, s + 1, t))
    return deps
  if a.kind == 'W':
    return [Action('I', s, t)]
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
  kinds = ['F'] + (['R'] if spec.recompute else []) + (
      ['I', 'W'] if split else ['B'])
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
        deps = _Deps(spec, a, split)
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
          need = [str(x) for x in _Deps(spec, a, split) if x not in end]
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
    inputs = [d for w in run for d in _Deps(spec, w, split)]
    for i, w in enumerate(run):
      deps[w] = inputs + run[i - 1:i]
  pending = [a for acts in schedule for a in acts]
  end = {}
  while pending:
    rest = []
    for a in pending:
      needs = deps[a] if a in deps else _Deps(spec, a, split)
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


def Build(name: str, spec: StageSpec) -> ScheduleLists:
  """The named schedule's lists for `spec`, checked.

  Args:
    name: A key of ACTION_SCHEDULES.
    spec: The pipeline.

  Returns:
    Per device, its ordered actions.
  """
  if name not in ACTION_SCHEDULES:
    raise ValueError('schedule=%r has no action list; use one of %s.' %
                     (name, sorted(ACTION_SCHEDULES)))
  schedule = ACTION_SCHEDULES[name](spec)
  CheckSchedule(spec, schedule)
  return schedule


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


# The (schedule, recompute) pairs whose weight-gradient runs the engine
# sizes with WeightGradientRunLength (`StageSpec.weight_gradient_run`);
# every other pair takes 1.
SIZED_WEIGHT_GRADIENT_RUNS = frozenset({('unrolled', True),
                                        ('1f1b', False)})


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
      if a.kind == 'W' and run and run[-1].stage == a.stage:
        run.append(a)
        continue
      if run:
        runs.append(run)
      run = [a] if a.kind == 'W' else []
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
