"""One record per schedule: everything the engine, the layer and the planner
know of it.

A schedule is a frozen `Schedule` record in `RECORDS`; every table of
schedule facts (`ACTION_SCHEDULES`, `ORDERED_KINDS`, `NAMES`,
`ALWAYS_RECOMPUTE`, `LINEAR_LOSS_ONLY`, `SIZED_WEIGHT_GRADIENT_RUNS`, the
layer's `schedule` help, its recompute check) is derived from the records.
Adding a schedule is one record here and one generator in generators.py.
Nothing here needs TensorFlow, so the planner can import it.
"""

import dataclasses
from typing import Callable
from typing import Dict
from typing import FrozenSet
from typing import Optional
from typing import Tuple

from lingvo_ext.pipeline import generators
from lingvo_ext.pipeline.kinds import KINDS
from lingvo_ext.pipeline.kinds import Kind
from lingvo_ext.pipeline.kinds import ScheduleLists
from lingvo_ext.pipeline.kinds import StageSpec
from lingvo_ext.pipeline.simulate import CheckSchedule

# `Schedule.recompute`: what the layer's recompute=None means.
NEVER, WHEN_NEEDED, ALWAYS = 'never', 'when_needed', 'always'
# `Schedule.nonlinear_loss`: what a loss not linear in the pipeline's outputs
# (no output gradient before every forward pass ends) does.
ANY_LOSS = 'any'  # Nothing: the lists run every forward pass first.
NEEDS_RECOMPUTE = 'recompute'  # Recompute (recompute=False is an error).
FORWARDS_FIRST = 'forwards_first'  # Each device's 'F's moved first.


@dataclasses.dataclass(frozen=True)
class PlannerFacts:
  """What the planner enumerates a schedule over.

  Attributes:
    cells_per_device: The V (cells per device) it takes; None: every V from
      2 up to layers // D.
    min_devices: Fewest devices D it is worth planning on.
    min_cells: Fewest cells K it is worth planning with.
    micro_batches_multiple_of_devices: Whether M must be a multiple of D.
    simulated_as: The schedule whose lists the planner simulates for it
      (None: its own).
    lingvo_loop: Whether it runs as Lingvo's loop (M + K - 1 steps, each
      running every cell), which the planner prices per loop step.
  """
  cells_per_device: Optional[Tuple[int, ...]] = (1,)
  min_devices: int = 1
  min_cells: int = 1
  micro_batches_multiple_of_devices: bool = False
  simulated_as: Optional[str] = None
  lingvo_loop: bool = False


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A pipeline schedule.

  Attributes:
    name: The `schedule` param's value.
    help: One line describing the schedule (its Schedule's docstring).
    generator: StageSpec -> each device's action list (generators.py);
      None for Lingvo's recurrent loop, which has no lists.
    ordered: Action kinds that wait for the action before them on their
      device (the interpreter's control edges); the others run when their
      inputs are ready, in whatever order TensorFlow's executor picks.
    recompute: What recompute=None means: NEVER, WHEN_NEEDED (only for a
      loss not linear in the outputs) or ALWAYS (recompute=False is an
      error).
    nonlinear_loss: What a loss not linear in the outputs does: ANY_LOSS,
      NEEDS_RECOMPUTE or FORWARDS_FIRST.
    sized_runs: The recompute values under which the engine sizes the
      weight-gradient runs (`StageSpec.weight_gradient_run`); else 1.
    placement: How cells sit on devices (`kinds.PLACEMENTS`).
    planner: What the planner enumerates it over.
    static_shapes: Whether it needs every input dimension known when the
      graph is built (Lingvo's loop sizes its states statically).
  """
  name: str
  help: str
  generator: Optional[Callable[[StageSpec], ScheduleLists]]
  ordered: Tuple[Kind, ...] = ()
  recompute: str = NEVER
  nonlinear_loss: str = ANY_LOSS
  sized_runs: FrozenSet[bool] = frozenset()
  placement: str = 'round_robin'
  planner: PlannerFacts = PlannerFacts()
  static_shapes: bool = False

  def RecomputeChoices(self, linear_loss: bool) -> Tuple[bool, ...]:
    """The recompute values worth planning for a loss (linear or not)."""
    if self.recompute == ALWAYS:
      return (True,)
    if self.nonlinear_loss == FORWARDS_FIRST:
      return (False,)
    if self.nonlinear_loss == NEEDS_RECOMPUTE and not linear_loss:
      return (True,)
    return (False, True)


RECORDS = (
    Schedule(
        'unrolled',
        "GPipe: all forward passes, then the backward passes as their "
        'inputs arrive; weight gradients one MatMul over all micro-batches.',
        generators.GPipe, ordered=(Kind.R,), sized_runs=frozenset({True})),
    Schedule(
        '1f1b',
        'One forward, one backward per cell in steady state: at most K - i '
        "micro-batches' activations in cell i; recomputes for a loss not "
        'linear in the outputs.',
        generators.OneFOneBGroupedWeights, ordered=(Kind.F, Kind.R),
        recompute=WHEN_NEEDED, nonlinear_loss=NEEDS_RECOMPUTE,
        sized_runs=frozenset({False}), planner=PlannerFacts(min_cells=2)),
    Schedule(
        'recurrent',
        "Lingvo's StackedRecurrent loop; always recomputes; embedding "
        'gradients come out dense.',
        None, recompute=ALWAYS, static_shapes=True,
        planner=PlannerFacts(simulated_as='unrolled', lingvo_loop=True)),
    Schedule(
        'interleaved_1f1b',
        "Megatron's interleaved 1F1B, V = K / D cells per device (K and M "
        'multiples of D); every action in its list order.',
        generators.Interleaved1F1B, ordered=KINDS,
        nonlinear_loss=FORWARDS_FIRST,
        planner=PlannerFacts(cells_per_device=None, min_devices=2,
                             micro_batches_multiple_of_devices=True)),
    Schedule(
        'zero_bubble',
        'ZB-H1: backward split into input gradients, sent upstream at once, '
        'and weight gradients filling the bubble; every action in order.',
        generators.ZeroBubble, ordered=KINDS, nonlinear_loss=FORWARDS_FIRST,
        planner=PlannerFacts(cells_per_device=(1, 2), min_devices=2)),
    Schedule(
        'zbv',
        "ZB-V: two cells per device placed in a V (device d holds cells d "
        'and 2D - 1 - d), backward split as ZB-H1; every action in order.',
        generators.ZeroBubbleV, ordered=KINDS, nonlinear_loss=FORWARDS_FIRST,
        placement='v', planner=PlannerFacts(cells_per_device=(2,),
                                            min_devices=2)),
)

BY_NAME: Dict[str, Schedule] = {r.name: r for r in RECORDS}
NAMES = tuple(BY_NAME)
# Schedules with action lists, by name: their generators.
ACTION_SCHEDULES = {r.name: r.generator for r in RECORDS if r.generator}
# The action kinds whose place in its device's list the engine enforces.
ORDERED_KINDS = {r.name: tuple(r.ordered) for r in RECORDS if r.generator}
# Schedules that always re-materialise (recompute=False is an error there).
ALWAYS_RECOMPUTE = tuple(r.name for r in RECORDS if r.recompute == ALWAYS)
# Schedules that overlap forward and backward passes only for a loss linear
# in the outputs; for other losses each device runs its forward actions first.
LINEAR_LOSS_ONLY = tuple(r.name for r in RECORDS
                         if r.nonlinear_loss == FORWARDS_FIRST)
# The (schedule, recompute) pairs whose weight-gradient runs the engine sizes.
SIZED_WEIGHT_GRADIENT_RUNS = frozenset(
    (r.name, rc) for r in RECORDS for rc in r.sized_runs)


def Get(name: str) -> Schedule:
  """The record of schedule `name`; ValueError naming the choices."""
  if name not in BY_NAME:
    raise ValueError('schedule=%r; use one of %s.' % (name, sorted(NAMES)))
  return BY_NAME[name]


def CheckName(name, where: str, key: str = 'schedule',
              override: str = '') -> None:
  """ValueError naming `where`, `key` and the schedules, unless one is `name`.

  The one check of a schedule's name: the layer, the task, the trainer's
  pre-check and the benches call it. `override` (a params path) adds the
  --model_params_override that would set one.
  """
  if name in BY_NAME:
    return
  fix = (f", e.g. --model_params_override='{override}:\"1f1b\"'"
         if override else '')
  raise ValueError(f'{where}: {key}={name!r}; use one of '
                   f'{sorted(NAMES)}{fix}.')


def Build(name: str, spec: StageSpec) -> ScheduleLists:
  """The named schedule's lists for `spec`, checked.

  Args:
    name: A key of ACTION_SCHEDULES.
    spec: The pipeline; its stages are placed as the schedule's record says
      (`Placed`).

  Returns:
    Per device, its ordered actions.
  """
  if name not in ACTION_SCHEDULES:
    raise ValueError('schedule=%r has no action list; use one of %s.' %
                     (name, sorted(ACTION_SCHEDULES)))
  spec = Placed(name, spec)
  schedule = ACTION_SCHEDULES[name](spec)
  CheckSchedule(spec, schedule)
  return schedule


def Placed(name: str, spec: StageSpec) -> StageSpec:
  """`spec` with the stage placement of schedule `name`'s record."""
  placement = BY_NAME[name].placement if name in BY_NAME else spec.placement
  if spec.placement == placement:
    return spec
  return dataclasses.replace(spec, placement=placement)


def RecomputeError(name: str, recompute, where: str) -> Optional[str]:
  """Why `recompute` does not go with schedule `name` (None if it does).

  Args:
    name: The schedule.
    recompute: None, True or False.
    where: How the caller names the params, e.g. 'task.' or ''.
  """
  if recompute is False and BY_NAME[name].recompute == ALWAYS:
    others = [r.name for r in RECORDS if r.recompute != ALWAYS][:2]
    return ("%srecompute=False, but %sschedule=%r always recomputes each "
            "cell's forward pass; set %srecompute to None or True, or use "
            '%sschedule %s to keep activations.' %
            (where, where, name, where, where,
             ' or '.join(repr(o) for o in others)))
  return None


# The schedule Lingvo's own engine (--gpipe_engine=lingvo) runs: its loop.
LINGVO_ENGINE = 'recurrent'


def Refusal(name: str, num_cells: int, num_devices: int,
            num_micro_batches: int, static_shapes: bool = True,
            where: str = '') -> Optional[str]:
  """Why schedule `name` cannot run this pipeline, in one line; None if it can.

  The one place the schedules' refusals live: the layer calls it when
  built, the trainer before anything is written, the planner before it
  offers a plan.

  Args:
    name: The schedule.
    num_cells: K, the pipeline's cells.
    num_devices: The devices of the model split (the cells occupy
      min(K, num_devices) of them).
    num_micro_batches: M.
    static_shapes: Whether every input dimension is known when the graph is
      built (False: e.g. a time axis a task trims at run time).
    where: How the caller names the params, e.g. 'task.lm.stack.'.
  """
  record = Get(name)
  k, m = num_cells, num_micro_batches
  dev = max(1, min(num_devices, k))
  if record.static_shapes and not static_shapes:
    others = [r.name for r in RECORDS if not r.static_shapes]
    return ('%sschedule=%r needs every input dimension known when the graph '
            'is built, and this input has one known only at run time; use %s' %
            (where, name, ', '.join(repr(o) for o in others)))
  if record.placement == 'v' and k > 1 and (k % 2 or 2 * dev > k):
    return ('%sschedule=%r: %d cells on %d devices; it places two cells on '
            'each device: use an even number of cells, at least twice the '
            'devices (%d), or another schedule' % (where, name, k, dev, 2 * dev))
  if record.planner.cells_per_device is None and k % dev:
    return ('%sschedule=%r: %d cells on %d devices; the number of cells must '
            'be a multiple of the number of devices (V cells per device)' %
            (where, name, k, dev))
  if record.planner.micro_batches_multiple_of_devices and m % dev:
    return ('%sschedule=%r: num_micro_batches=%d must be a multiple of the '
            'number of devices (%d); use %d' %
            (where, name, m, dev, max(dev, m // dev * dev)))
  return None


def ScheduleHelp() -> str:
  """The `schedule` param's help: the records' names (details in the docs)."""
  return ('How micro-batches flow through the cells: one of %s. See '
          'docs/schedules.md.' % ', '.join("'%s'" % r.name for r in RECORDS))
