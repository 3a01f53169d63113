"""Plans: the ways to run a model on N devices, and their enumeration.

A `Plan` is what is chosen (cells and their cut, devices per replica,
micro-batches, schedule, recompute, replicas, gradient_sync, batch); a
`Prediction` what `prediction.Predict` says of it; a `Measurement` what
timing it found; a `Candidate` the three together, as the choice ranks them.
`Enumerate` lists every plan (pure Python).
"""

import dataclasses
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo_ext.pipeline import partitioning
from lingvo_ext.pipeline import records
from lingvo_ext.planner.model_profile import ModelProfile

# gradient_sync strategies the planner offers for R > 1 (the ps strategies
# need a ps job; see distributed/sync/).
SYNC_CHOICES = ('shared', 'all_reduce')
MAX_MICRO_BATCHES = 32


@dataclasses.dataclass(frozen=True)
class Plan:
  """One way to run the model on the devices.

  Attributes:
    num_cells: K.
    sizes: Layers per cell (the exact min-max FLOPs cut).
    devices_per_replica: D (D = K unless 'interleaved_1f1b').
    num_micro_batches: M.
    schedule: A key of schedules.SCHEDULES.
    recompute: Re-materialisation.
    replicas: R.
    gradient_sync: The strategy among replicas (one of SYNC_CHOICES).
    global_batch: Examples per step over all replicas.
    jit_compile: The cells' XLA build: 'auto' (the faster, timed before the
      model is built, runtime/jit_resolve.py), True or False.
  """
  num_cells: int
  sizes: Tuple[int, ...]
  devices_per_replica: int
  num_micro_batches: int
  schedule: str
  recompute: bool
  replicas: int
  gradient_sync: str
  global_batch: int
  jit_compile: object = 'auto'

  @property
  def devices(self) -> int:
    return self.devices_per_replica * self.replicas

  @property
  def replica_batch(self) -> int:
    return self.global_batch // self.replicas

  def Key(self) -> str:
    """A short label: K2xR1 M4 1f1b+rc all_reduce."""
    label = 'K%d' % self.num_cells
    if self.devices_per_replica != self.num_cells:
      label += '/D%d' % self.devices_per_replica
    label += 'xR%d M%d %s' % (self.replicas, self.num_micro_batches,
                              self.schedule)
    if self.recompute and self.schedule not in records.ALWAYS_RECOMPUTE:
      label += '+rc'
    if self.replicas > 1:
      label += ' ' + self.gradient_sync
    if self.jit_compile != 'auto':
      label += ' xla' if self.jit_compile else ' no-xla'
    return label

  def ToDict(self) -> Dict:
    out = dataclasses.asdict(self)
    out['sizes'] = list(self.sizes)
    out['devices'] = self.devices
    out['key'] = self.Key()
    return out


def PlanFromDict(d: Dict) -> Plan:
  """The Plan of Plan.ToDict() or Candidate.ToDict() (extra keys ignored)."""
  fields = {f.name for f in dataclasses.fields(Plan)}
  d = {k: v for k, v in d.items() if k in fields}
  d['sizes'] = tuple(d['sizes'])
  return Plan(**d)


@dataclasses.dataclass(frozen=True)
class Prediction:
  """A plan's predicted figures (`prediction.Predict`).

  Attributes:
    step_s: Predicted step seconds.
    bubble: Predicted idle fraction of the pipeline's devices.
    peak_bytes: Predicted peak bytes on the fullest device.
    process_bytes: Predicted peak bytes of one process holding all devices,
      Machine.overhead_bytes included.
    comm_bytes: Bytes sent between devices per step (activations and their
      gradients between cells, gradient synchronisation among replicas).
  """
  step_s: float
  bubble: float
  peak_bytes: float
  process_bytes: float
  comm_bytes: float


@dataclasses.dataclass(frozen=True)
class Measurement:
  """A plan's measured figures (tools/plan.py --measure, bench/plan.py).

  Attributes:
    step_s: Measured step seconds (the least of `times` where timed in
      rounds).
    rss_bytes: Measured peak resident set of the process, or None.
    times: The step seconds of each paired round, or None.
  """
  step_s: Optional[float] = None
  rss_bytes: Optional[float] = None
  times: Optional[Tuple[float, ...]] = None


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A plan with its prediction (and measurement), as the choice ranks them.

  Reads as its plan (`num_cells`, `Key()`, ...) and its figures (`step_s`,
  `peak_bytes`, `measured_step_s`, ...).
  """
  plan: Plan
  prediction: Prediction
  measurement: Measurement = Measurement()

  def __getattr__(self, name):
    if name.startswith('_') or name in ('plan', 'prediction', 'measurement'):
      raise AttributeError(name)
    return getattr(self.plan, name)

  step_s = property(lambda self: self.prediction.step_s)
  bubble = property(lambda self: self.prediction.bubble)
  peak_bytes = property(lambda self: self.prediction.peak_bytes)
  process_bytes = property(lambda self: self.prediction.process_bytes)
  comm_bytes = property(lambda self: self.prediction.comm_bytes)
  measured_step_s = property(lambda self: self.measurement.step_s)
  measured_rss_bytes = property(lambda self: self.measurement.rss_bytes)

  @property
  def measured_times(self) -> Optional[List[float]]:
    times = self.measurement.times
    return None if times is None else list(times)

  def Measured(self, **fields) -> 'Candidate':
    """A copy with `fields` of its Measurement replaced."""
    if fields.get('times') is not None:
      fields['times'] = tuple(fields['times'])
    return dataclasses.replace(
        self, measurement=dataclasses.replace(self.measurement, **fields))

  def ToDict(self) -> Dict:
    out = self.plan.ToDict()
    out.update(dataclasses.asdict(self.prediction))
    out.update(measured_step_s=self.measured_step_s,
               measured_rss_bytes=self.measured_rss_bytes,
               measured_times=self.measured_times)
    return out


def PlanOf(plan_or_candidate) -> Plan:
  """The Plan of a Plan or a Candidate."""
  return getattr(plan_or_candidate, 'plan', plan_or_candidate)


class PlanError(ValueError):
  """No plan: the message is one line and says what would fit."""


# --- Enumeration --------------------------------------------------------------


def Divisors(n: int, limit: int) -> List[int]:
  """The divisors of n up to limit."""
  return [m for m in range(1, min(n, limit) + 1) if n % m == 0]


def Enumerate(profile: ModelProfile, devices: int,
              global_batch: Optional[int] = None,
              schedules: Sequence[str] = records.NAMES,
              max_micro_batches: int = MAX_MICRO_BATCHES,
              sync_choices: Sequence[str] = SYNC_CHOICES,
              micro_batches: Optional[Sequence[int]] = None,
              jit_choices: Sequence[object] = ('auto',),
              static_shapes: bool = True) -> List[Plan]:
  """Every plan of `profile` on at most `devices` devices (not predicted).

  Args:
    profile: The model.
    devices: N, the devices available.
    global_batch: Examples per step over all replicas (default the model's).
    schedules: Schedules to consider.
    max_micro_batches: Largest M considered.
    sync_choices: gradient_sync strategies considered when R > 1.
    micro_batches: If given, only these M.
    jit_choices: jit_compile values considered: 'auto' leaves it to the
      timing when the model is built; (False, True) predicts both
      (prediction.Predict). Lingvo's loop has no XLA build: its plans take
      the choices but True.
    static_shapes: Whether the pipeline's inputs have every dim known when
      the graph is built (False: a time axis trimmed at run time).

  Returns:
    The plans: D * R <= N, R divides the global batch, M divides the replica
    batch, and the schedule applies (see the module docstring), none that
    the pipeline would refuse when built (`records.Refusal`).
  """
  if devices < 1:
    raise ValueError('devices=%r must be >= 1.' % (devices,))
  batch = global_batch or profile.batch
  num_layers = len(profile.layers)
  flops = [l.flops for l in profile.layers]
  cuts = {}
  plans = []
  for d in range(1, min(devices, num_layers) + 1):
    for r in range(1, devices // d + 1):
      if batch % r:
        continue
      syncs = list(sync_choices) if r > 1 else ['shared']
      rb = batch // r
      ms = Divisors(rb, max_micro_batches)
      if micro_batches:
        ms = [m for m in ms if m in micro_batches]
      for name in schedules:
        record = records.Get(name)
        facts = record.planner
        jits = list(jit_choices)
        if facts.lingvo_loop:
          jits = [j for j in jits if j is not True] or [False]
        if d < facts.min_devices:
          continue  # E.g. one stage: nothing to overlap.
        if facts.cells_per_device is None:
          ks = [v * d for v in range(2, num_layers // d + 1)]
        else:
          ks = [v * d for v in facts.cells_per_device if v * d <= num_layers]
        recomputes = record.RecomputeChoices(profile.linear_loss)
        for k in ks:
          if k < facts.min_cells:
            continue  # E.g. one cell: '1f1b' is 'unrolled'.
          if k not in cuts:
            cuts[k] = tuple(partitioning.MinMaxPartition(flops, k))
          for m in ms:
            if facts.micro_batches_multiple_of_devices and m % d:
              continue
            for rc in recomputes:
              for sync in syncs:
                plans += [Plan(
                    num_cells=k, sizes=cuts[k], devices_per_replica=d,
                    num_micro_batches=m, schedule=name, recompute=rc,
                    replicas=r, gradient_sync=sync, global_batch=batch,
                    jit_compile=jit) for jit in jits]
  # The builder's own conditions, so that no plan offered is refused.
  return [p for p in plans if records.Refusal(
      p.schedule, p.num_cells, p.devices_per_replica, p.num_micro_batches,
      static_shapes=static_shapes) is None]


# --- Prediction ---------------------------------------------------------------
