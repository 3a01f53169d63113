"""An automatic pipeline plan: cells, cut, micro-batches, schedule, replicas.

Given a model's per-layer profile (`ModelProfile`: forward FLOPs, op counts,
parameter bytes and the activation bytes each layer keeps for its backward
pass, per example) and N devices, `Enumerate` lists every plan

  K cells (cut by the exact min-max FLOPs cut, as `PartitionSequentialLayers`
  cuts them), D devices per replica (D = K, or K / V for 'interleaved_1f1b',
  and K / 2 for 'zero_bubble' too),
  M micro-batches, a schedule of `schedules.SCHEDULES`, recompute, R
  data-parallel replicas with D * R <= N, and a gradient_sync strategy,

and `Predict` fills in, for each, the step time and the peak memory per device
from the schedule's own action lists (`actions.Build`) simulated over the
per-stage costs (`actions.Simulate`):

- Action cost: ops x seconds per op + FLOPs / FLOP rate (`Machine`), for the
  stage's layers at the micro-batch size; a backward pass is 2x the forward
  FLOPs and its own op count; 'R' is a forward pass again. What the engines
  add: a hand-off (`Machine.s_per_handoff` and the bytes) for each tensor an
  action receives from another device, a gate (`Machine.s_per_gate`) per
  enforced action (`GatedKinds`, `actions.ORDERED_KINDS`), and the sums of
  the weight gradients over micro-batches (`Accumulations`). Lingvo's
  'recurrent' loop runs M + K - 1 steps, each running every cell
  (`_RecurrentCompute`).
  Devices that share
  fewer cores than they are (CPU devices of one host) cannot all compute at
  once: the step is at least the replicas' total work over the cores.
- Memory per device: parameters, their gradients and optimizer slots (the
  experiment's optimizer: Adam 2 slots, Momentum 1, SGD 0), plus activations:
  `PeakInFlight` (the simulated most micro-batch stages alive at once) x the
  stage's kept activations per micro-batch; with recompute only the cells'
  boundary inputs stay for every micro-batch, and one micro-batch's full
  activations during its backward pass. The pipeline's whole-batch input and
  output (and the output's gradient) live on the first and last devices.

'unrolled' and 'recurrent' run GPipe's order (all forward passes, then the
backward passes; 'recurrent' is Lingvo's StackedRecurrent loop, which always
recomputes). With a loss that is not linear in the pipeline's outputs no
backward pass can start before every forward pass ends (schedules.py):
'1f1b' then recomputes, so the planner offers it only with recompute there,
and '1f1b', 'interleaved_1f1b' and 'zero_bubble' run each device's forward
actions first (`actions.ForwardsFirst`), which is what is simulated.

Everything here is pure Python. The TensorFlow half (profiling a registered
experiment's layers, probing the machine's FLOP rate and per-op time,
applying a plan to experiment params) is in the functions marked "(TF)",
which import TensorFlow only when called.
"""

import dataclasses
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

from lingvo_ext.core import actions
from lingvo_ext.core import partitioning

# Schedules by name, as PipeliningLayer's `schedule` param takes them (the
# keys of schedules.SCHEDULES; kept here so this module needs no TF).
SCHEDULE_NAMES = ('unrolled', '1f1b', 'recurrent', 'interleaved_1f1b',
                  'zero_bubble')
ALWAYS_RECOMPUTE = ('recurrent',)
# Schedules that never recompute (action lists run as they are).
LIST_SCHEDULES = ('interleaved_1f1b', 'zero_bubble')
# gradient_sync strategies the planner offers for R > 1 (the ps strategies
# need a ps job; see gradient_sync.py).
SYNC_CHOICES = ('shared', 'all_reduce')
# Op times per variable per replica that a step spends synchronising
# gradients, beyond the bytes: none for 'shared' (the replicas read one copy
# and tf.gradients sums their gradients in the backward pass it builds
# anyway); a collective's rendezvous and its plumbing for 'all_reduce'
# (measured 1.4-1.9x 'shared' on this project's models). The values that
# ranked the bench/plan.py sweeps of 2026-11-24 best (the LM's Spearman
# 0.86-0.90 -> 0.90-0.95 against 3 for both, the image model's 0.92-0.94 ->
# 0.93-0.95).
SYNC_OPS_PER_VAR = {'shared': 0, 'all_reduce': 6}
# Optimizer slots per parameter, by Lingvo optimizer class name.
OPTIMIZER_SLOTS = {'Adam': 2, 'AdamW': 2, 'Adagrad': 1, 'Momentum': 1,
                   'RMSProp': 2, 'SGD': 0, 'Adafactor': 1}
MAX_MICRO_BATCHES = 32
_SIZE_UNITS = {'': 1, 'B': 1, 'K': 2**10, 'KB': 2**10, 'KIB': 2**10,
               'M': 2**20, 'MB': 2**20, 'MIB': 2**20, 'G': 2**30,
               'GB': 2**30, 'GIB': 2**30, 'T': 2**40, 'TB': 2**40,
               'TIB': 2**40}


def ParseSize(text: str) -> int:
  """'512MB', '2G', '1.5GiB', '300000' -> bytes (units are powers of 1024).

  Raises:
    ValueError: not a number followed by one of B, K(B), M(B), G(B), T(B).
  """
  s = str(text).strip().upper().replace(' ', '')
  i = len(s)
  while i and not (s[i - 1].isdigit() or s[i - 1] == '.'):
    i -= 1
  number, unit = s[:i], s[i:]
  if unit not in _SIZE_UNITS or not number:
    raise ValueError('%r is not a size; write a number and a unit, e.g. '
                     '512MB, 2GB or 1.5GiB.' % (text,))
  try:
    value = float(number)
  except ValueError:
    raise ValueError('%r is not a size; write a number and a unit, e.g. '
                     '512MB, 2GB or 1.5GiB.' % (text,)) from None
  if value <= 0 or math.isinf(value):
    raise ValueError('%r must be a positive size, e.g. 512MB.' % (text,))
  return int(value * _SIZE_UNITS[unit])


def FormatSize(num_bytes: float) -> str:
  """Bytes as the largest unit that keeps a number >= 1 (1024-based)."""
  for unit, scale in (('GB', 2**30), ('MB', 2**20), ('KB', 2**10)):
    if abs(num_bytes) >= scale:
      return '%.1f%s' % (num_bytes / scale, unit)
  return '%dB' % num_bytes


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """What the planner knows of one layer of the stack.

  Attributes:
    name: The layer's name.
    flops: Forward FLOPs per example (FPropMeta).
    fwd_ops: Ops of its forward pass (independent of the batch).
    bwd_ops: Ops of its backward pass.
    param_bytes: Bytes of its variables.
    num_vars: Number of its variables.
    out_bytes: Bytes of its outputs per example (FPropMeta shapes).
    kept_bytes: Bytes its backward pass reads from the forward pass per
      example (the activations kept alive between them; at least out_bytes).
  """
  name: str
  flops: float
  fwd_ops: int
  bwd_ops: int
  param_bytes: int
  num_vars: int
  out_bytes: float
  kept_bytes: float


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  """A layer stack as the planner sees it.

  Attributes:
    name: The experiment (or benchmark) name.
    layers: The stack's layers, in order.
    batch: The default global batch size.
    in_bytes: Bytes of the stack's input per example.
    optimizer_slots: Optimizer slot variables per parameter.
    linear_loss: Whether the loss is linear in the pipeline's outputs (per
      example losses summed in the last cell), which '1f1b' without
      recompute, 'interleaved_1f1b' and 'zero_bubble' need.
    loss_ops: Ops of the loss and its gradient outside the pipeline.
    cell_functions: Whether the pipeline builds each cell once, as a function
      called per micro-batch (PipeliningLayer.cell_functions, the default),
      rather than a copy per micro-batch (see GraphOps).
  """
  name: str
  layers: Tuple[LayerProfile, ...]
  batch: int
  in_bytes: float
  optimizer_slots: int = 2
  linear_loss: bool = False
  loss_ops: int = 20
  cell_functions: bool = True

  @property
  def param_bytes(self) -> int:
    return sum(l.param_bytes for l in self.layers)

  @property
  def num_vars(self) -> int:
    return sum(l.num_vars for l in self.layers)


@dataclasses.dataclass(frozen=True)
class Machine:
  """The costs of compute on the devices planned for.

  Attributes:
    flops_per_s: FLOP rate of one device.
    s_per_op: Fixed time of one op (executor dispatch, kernel launch).
    bytes_per_s: Rate of moving bytes between devices (and of updates).
    cores: How many devices can compute at once (CPU devices of one host
      share its cores, and other processes' load takes its share); None: all
      of them. May be fractional. Where it is set, a device whose actions
      are not held to their lists (`GatedKinds`) runs several at once, up to
      the cores (TensorFlow's executor over the host's threads); else each
      device runs one action at a time.
    step_s: Fixed time of a training step (session run, input, summaries).
    update_ops_per_var: Ops of one variable's optimizer update.
    recurrent_op_factor: 'recurrent' only: the time of an op inside Lingvo's
      StackedRecurrent loop (a function the loop calls per micro-batch)
      over s_per_op.
    recurrent_s_per_byte: 'recurrent' only: seconds per byte of a cell's
      weights for each step of Lingvo's loop after its first (what the loop
      does with the weights and their gradients per step beyond the ops;
      none for one step).
    bytes_per_op: Process memory per op of the step's graph (graph,
      executor and kernel state, allocator slack).
    overhead_bytes: Process memory besides the model and its graph (TF
      runtime, input data); counted in the process total, not per device.
    s_per_handoff: Fixed time of one tensor handed from one device to
      another (a Send/Recv pair and its rendezvous), on top of its bytes over
      bytes_per_s: what a cell pays per micro-batch for its input (and its
      output's gradient) coming from a cell on another device.
    s_per_gate: Time an enforced action pays for its gate and
      completion (two NoOps and control edges that hold it behind the action
      before it on its device): the kinds of `actions.ORDERED_KINDS`, every
      action of 'interleaved_1f1b' and 'zero_bubble', the forward passes
      (and recomputations) of '1f1b'.
    add_bytes_per_s: Bytes per second an add of layer-sized tensors moves
      (two read, one written): the rate at which weight gradients are
      summed over micro-batches (`Accumulations`).
    s_per_reduced_var: Time per variable and replica that 'all_reduce'
      spends synchronising gradients beyond their bytes (a collective per
      variable and its rendezvous across the replicas' devices); None:
      SYNC_OPS_PER_VAR ops of s_per_op. Calibrate fits it.
  """
  flops_per_s: float = 2e10
  s_per_op: float = 2e-5
  bytes_per_s: float = 5e9
  cores: Optional[float] = None
  step_s: float = 2e-3
  update_ops_per_var: int = 12
  recurrent_op_factor: float = 1.
  recurrent_s_per_byte: float = 0.
  bytes_per_op: float = 0.
  overhead_bytes: float = 0.
  s_per_handoff: float = 0.
  s_per_gate: float = 0.
  add_bytes_per_s: float = 5e10
  s_per_reduced_var: Optional[float] = None

  def Parallel(self, devices: int) -> float:
    return devices if self.cores is None else max(1., min(devices, self.cores))


@dataclasses.dataclass
class Plan:
  """One way to run the model on the devices, and its predicted figures.

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
    step_s: Predicted step seconds.
    bubble: Predicted idle fraction of the pipeline's devices.
    peak_bytes: Predicted peak bytes on the fullest device.
    process_bytes: Predicted peak bytes of one process holding all devices,
      Machine.overhead_bytes included.
    comm_bytes: Bytes sent between devices per step (activations and their
      gradients between cells, gradient synchronisation among replicas).
    measured_step_s: Measured step seconds (--measure), or None.
    measured_rss_bytes: Measured peak resident set of the process, or None.
    measured_times: The step seconds of each measured round (--measure), or
      None; measured_step_s is their least.
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
  step_s: float = 0.
  bubble: float = 0.
  peak_bytes: float = 0.
  process_bytes: float = 0.
  comm_bytes: float = 0.
  measured_step_s: Optional[float] = None
  measured_rss_bytes: Optional[float] = None
  measured_times: Optional[List[float]] = None

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
    if self.recompute and self.schedule not in ALWAYS_RECOMPUTE:
      label += '+rc'
    if self.replicas > 1:
      label += ' ' + self.gradient_sync
    return label

  def ToDict(self) -> Dict:
    out = dataclasses.asdict(self)
    out['sizes'] = list(self.sizes)
    out['devices'] = self.devices
    out['key'] = self.Key()
    return out


class PlanError(ValueError):
  """No plan: the message is one line and says what would fit."""


# --- Enumeration --------------------------------------------------------------


def _Divisors(n: int, limit: int) -> List[int]:
  return [m for m in range(1, min(n, limit) + 1) if n % m == 0]


def Enumerate(profile: ModelProfile, devices: int,
              global_batch: Optional[int] = None,
              schedules: Sequence[str] = SCHEDULE_NAMES,
              max_micro_batches: int = MAX_MICRO_BATCHES,
              sync_choices: Sequence[str] = SYNC_CHOICES,
              micro_batches: Optional[Sequence[int]] = None) -> List[Plan]:
  """Every plan of `profile` on at most `devices` devices (not predicted).

  Args:
    profile: The model.
    devices: N, the devices available.
    global_batch: Examples per step over all replicas (default the model's).
    schedules: Schedules to consider.
    max_micro_batches: Largest M considered.
    sync_choices: gradient_sync strategies considered when R > 1.
    micro_batches: If given, only these M.

  Returns:
    The plans: D * R <= N, R divides the global batch, M divides the replica
    batch, and the schedule applies (see the module docstring).
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
      ms = _Divisors(rb, max_micro_batches)
      if micro_batches:
        ms = [m for m in ms if m in micro_batches]
      for name in schedules:
        if name == 'zero_bubble' and d == 1:
          continue  # One stage: nothing to overlap; it is 'unrolled'.
        if name == 'interleaved_1f1b':
          ks = [v * d for v in range(2, num_layers // d + 1)] if d > 1 else []
        elif name == 'zero_bubble':
          # Also 2 cells per device: the engine folds the one-cell-per-device
          # order onto the D devices (actions.FoldOntoDevices). Not more: each
          # V costs the enumeration a simulation of V * D stages per M.
          ks = [v * d for v in (1, 2) if v * d <= num_layers]
        else:
          ks = [d]
        if name == 'recurrent':
          recomputes = [True]
        elif name in LIST_SCHEDULES:
          recomputes = [False]
        elif name == '1f1b' and not profile.linear_loss:
          recomputes = [True]
        else:
          recomputes = [False, True]
        for k in ks:
          if k not in cuts:
            cuts[k] = tuple(partitioning.MinMaxPartition(flops, k))
          for m in ms:
            if name == 'interleaved_1f1b' and m % d:
              continue
            if name == '1f1b' and k == 1:
              continue  # One cell: '1f1b' is 'unrolled'.
            for rc in recomputes:
              for sync in syncs:
                plans.append(Plan(
                    num_cells=k, sizes=cuts[k], devices_per_replica=d,
                    num_micro_batches=m, schedule=name, recompute=rc,
                    replicas=r, gradient_sync=sync, global_batch=batch))
  return plans


# --- Prediction ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stage:
  flops: float  # Per example, forward.
  fwd_ops: int
  bwd_ops: int
  param_bytes: int
  num_vars: int
  in_bytes: float  # Per example: the boundary input kept under recompute.
  out_bytes: float
  kept_bytes: float  # Per example.


def Stages(profile: ModelProfile, sizes: Sequence[int]) -> List[_Stage]:
  """The per-cell sums of the layers' profiles for the cut `sizes`."""
  out, start = [], 0
  in_bytes = profile.in_bytes
  for s in sizes:
    group = profile.layers[start:start + s]
    start += s
    out.append(_Stage(
        flops=sum(l.flops for l in group),
        fwd_ops=sum(l.fwd_ops for l in group),
        bwd_ops=sum(l.bwd_ops for l in group),
        param_bytes=sum(l.param_bytes for l in group),
        num_vars=sum(l.num_vars for l in group),
        in_bytes=in_bytes,
        out_bytes=group[-1].out_bytes,
        kept_bytes=sum(l.kept_bytes for l in group)))
    in_bytes = group[-1].out_bytes
  return out


def WeightGradientRun(plan: Plan, stages: Sequence[_Stage]) -> int:
  """'unrolled' with recompute, '1f1b' without: how many micro-batches'
  weight gradients its engine computes at once
  (`actions.StageSpec.weight_gradient_run`).

  `actions.WeightGradientRunLength`, as the engine, with the stages' kept
  activations standing in for the MatMul operands. 1 for other plans.
  """
  if (plan.schedule,
      bool(plan.recompute)) not in actions.SIZED_WEIGHT_GRADIENT_RUNS:
    return 1
  mb = plan.replica_batch // plan.num_micro_batches
  return actions.WeightGradientRunLength(
      sum(st.param_bytes for st in stages),
      sum(st.kept_bytes for st in stages) * mb, plan.num_micro_batches)


def ActionSchedule(plan: Plan, linear_loss: bool = True,
                   weight_gradient_run: int = 1
                  ) -> Tuple[actions.StageSpec, List]:
  """The plan's action lists, as its engine runs them: the schedule's own
  (GPipe's for 'recurrent', whose loop runs all forward passes first); for a
  loss not linear in the outputs, forward actions first. `weight_gradient_run`
  is `WeightGradientRun`'s."""
  spec = actions.StageSpec(plan.num_cells, plan.devices_per_replica,
                           plan.num_micro_batches, recompute=plan.recompute,
                           weight_gradient_run=weight_gradient_run)
  name = 'unrolled' if plan.schedule == 'recurrent' else plan.schedule
  schedule = actions.Build(name, spec)
  if not linear_loss:  # GPipe's lists are in that order already.
    schedule = actions.ForwardsFirst(schedule)
  return spec, schedule


def GatedKinds(plan: Plan) -> Tuple[str, ...]:
  """Action kinds the plan's engine gates (holds behind a NoOp that waits
  for the action before it): `actions.ORDERED_KINDS`, none for
  'recurrent'."""
  return tuple(actions.ORDERED_KINDS.get(plan.schedule, ()))


def Accumulations(plan: Plan, weight_gradient_run: int = 1) -> int:
  """Times each weight's gradient is added to its running sum per step.

  'unrolled' batches a weight's gradient over all micro-batches into one
  MatMul (its run of 'W' actions, matmul_grad): none; with recompute, runs
  of `weight_gradient_run` (`WeightGradientRun`): ceil(M / run) - 1. '1f1b'
  batches runs of max(K, run) micro-batches and sums the runs; with
  recompute it takes whole backward passes ('B'), as the list schedules do
  ('B' or 'W'): one gradient per micro-batch, M - 1. Lingvo's
  StackedRecurrent loop adds each of its M + K - 1 backward steps' gradients
  to its accumulator: M + K - 2 after the first. Read off the plan's action
  lists (`SummingActions`), as the step's price is, but for 'recurrent'.
  """
  k, m = plan.num_cells, plan.num_micro_batches
  if plan.schedule == 'recurrent':
    return m + k - 2
  _, schedule = ActionSchedule(plan, weight_gradient_run=weight_gradient_run)
  return len(SummingActions(plan, schedule)) // k


def AccumulateSeconds(stage: _Stage, machine: Machine,
                      s_per_op: float) -> float:
  """One sum of a stage's weight gradients into their running sums: an add
  per variable, reading two and writing one of its bytes."""
  return (stage.num_vars * s_per_op +
          3. * stage.param_bytes / machine.add_bytes_per_s)


def HandoffBytes(stages: Sequence[_Stage], spec: actions.StageSpec,
                 a: actions.Action, micro_batch: int) -> Optional[float]:
  """Bytes action `a` receives from another device, or None if it receives
  nothing across devices: a forward pass its input from the stage before it,
  a backward pass ('B' or 'I') its output's gradient from the stage after."""
  s = a.stage
  if a.kind == 'F' and s > 0 and spec.Device(s - 1) != spec.Device(s):
    return stages[s].in_bytes * micro_batch
  if (a.kind in ('B', 'I') and s + 1 < spec.num_stages and
      spec.Device(s + 1) != spec.Device(s)):
    return stages[s].out_bytes * micro_batch
  return None


def _Costs(stages: Sequence[_Stage], micro_batch: int, machine: Machine,
           s_per_op: float, spec: Optional[actions.StageSpec] = None,
           gated: Sequence[str] = (), summing=frozenset()):
  """Action -> seconds for the stages at `micro_batch` examples: compute,
  plus with `spec` the hand-off of what it receives from another device,
  plus a gate if its kind is `gated`, plus a sum of the stage's weight
  gradients if it is in `summing`."""

  def Cost(a: actions.Action) -> float:
    st = stages[a.stage]
    fwd = st.fwd_ops * s_per_op + (
        st.flops * micro_batch / machine.flops_per_s)
    bwd = st.bwd_ops * s_per_op + (
        2 * st.flops * micro_batch / machine.flops_per_s)
    if a.kind in ('F', 'R'):
      out = fwd
    elif a.kind == 'B':
      out = bwd
    else:
      out = bwd / 2  # 'I' or 'W'.
    if spec is not None:
      received = HandoffBytes(stages, spec, a, micro_batch)
      if received is not None:
        out += machine.s_per_handoff + received / machine.bytes_per_s
    if a.kind in gated:
      out += machine.s_per_gate
    if a in summing:
      out += AccumulateSeconds(st, machine, s_per_op)
    return out

  return Cost


def SummingActions(plan: Plan, schedule: List) -> frozenset:
  """The actions after which a stage adds weight gradients to their sums
  (`Accumulations` per stage; 'recurrent' prices its own per loop step):
  each 'B' and the last 'W' of each run of 'W's
  (`actions.WeightGradientRuns`), but a stage's first, in its device's
  order."""
  if plan.schedule == 'recurrent':
    return frozenset()
  runs = {run[0]: run for run in actions.WeightGradientRuns(schedule)}
  out, seen = set(), set()
  for acts in schedule:
    for a in acts:
      if a.kind == 'B' or a in runs:
        last = runs[a][-1] if a in runs else a
        if a.stage in seen:
          out.add(last)
        seen.add(a.stage)
  return frozenset(out)


def _RecurrentCompute(stages: Sequence[_Stage], spec: actions.StageSpec,
                      cost, summing: Sequence[float] = (),
                      s_per_byte: float = 0.) -> Tuple[float, float, float]:
  """(makespan, busy, useful busy) of Lingvo's StackedRecurrent loop.

  The loop runs M + K - 1 steps forward and as many backward, and every step
  runs every cell (on its device), the bubble's steps on padding: so each
  step takes its slowest device's time, and every cell computes M + K - 1
  times, not M. Backward steps recompute the cell's forward pass; each step
  after the first adds the cell's weight gradients to the loop's
  accumulators (`summing`, seconds per cell) and costs `s_per_byte` per
  byte of its weights (`Machine.recurrent_s_per_byte`).
  """
  steps = spec.num_micro_batches + spec.num_stages - 1
  fwd = [cost(actions.Action('F', s, 0)) for s in range(len(stages))]
  bwd = [cost(actions.Action('R', s, 0)) + cost(actions.Action('B', s, 0))
         for s in range(len(stages))]
  more = [(summing[s] if summing else 0.) + s_per_byte * st.param_bytes
          for s, st in enumerate(stages)]

  def Slowest(xs):
    return max(sum(xs[s] for s in spec.Stages(d))
               for d in range(spec.num_devices))

  busy = steps * (sum(fwd) + sum(bwd)) + (steps - 1) * sum(more)
  makespan = (steps * (Slowest(fwd) + Slowest(bwd)) +
              (steps - 1) * Slowest(more))
  # The bubble: the padded steps' share (M of the M + K - 1 are real).
  return makespan, busy, busy * spec.num_micro_batches / steps


def _SyncBytes(plan: Plan, param_bytes: float) -> float:
  """Bytes all replicas send per step to synchronise gradients."""
  r = plan.replicas
  if r == 1:
    return 0.
  if plan.gradient_sync == 'all_reduce':
    return 2. * (r - 1) * param_bytes  # Ring: 2(R-1)/R per replica, R of them.
  # 'shared' (one copy read by every replica) and the ps strategies: each
  # other replica reads the weights and sends its gradients back.
  return 2. * (r - 1) * param_bytes


def Predict(profile: ModelProfile, plan: Plan,
            machine: Machine = Machine()) -> Plan:
  """Fills in the plan's predicted step time, bubble, memory and bytes."""
  stages = Stages(profile, plan.sizes)
  mb = plan.replica_batch // plan.num_micro_batches
  spec, schedule = ActionSchedule(plan, profile.linear_loss,
                                  WeightGradientRun(plan, stages))
  s_per_op = machine.s_per_op
  if plan.schedule == 'recurrent':
    s_per_op *= machine.recurrent_op_factor
  gated = GatedKinds(plan)
  cost = _Costs(stages, mb, machine, s_per_op, spec, gated,
                SummingActions(plan, schedule))
  tl = actions.Simulate(spec, schedule, cost)
  r = plan.replicas
  if plan.schedule == 'recurrent':
    makespan, busy, useful = _RecurrentCompute(
        stages, spec, cost,
        [AccumulateSeconds(st, machine, s_per_op) for st in stages],
        machine.recurrent_s_per_byte)
    plan.bubble = 1. - useful / (makespan * spec.num_devices)
  else:
    makespan = tl.makespan
    busy = sum(tl.end[a] - tl.start[a] for a in tl.start)
    plan.bubble = tl.IdleFraction()
  parallel = machine.Parallel(plan.devices)
  if machine.cores is not None and plan.schedule != 'recurrent' and not any(
      a.kind in gated for acts in schedule for a in acts):
    # Nothing holds the actions to their lists, and the devices share the
    # host's cores: TensorFlow's executor runs whatever is ready, several
    # actions of one device at once (one cell over two micro-batches keeps
    # two cores busy).
    makespan = actions.CriticalPath(spec, schedule, cost)
    parallel = max(1., machine.cores)
  # The replicas' work over the compute that can run at once.
  compute = max(makespan, r * busy / parallel)
  param_bytes = profile.param_bytes
  num_vars = profile.num_vars
  update = (num_vars * machine.update_ops_per_var * machine.s_per_op +
            (2 + profile.optimizer_slots) * param_bytes / machine.bytes_per_s)
  sync_bytes = _SyncBytes(plan, param_bytes)
  sync = sync_bytes / machine.bytes_per_s
  if r > 1:
    per_var = SYNC_OPS_PER_VAR[plan.gradient_sync] * machine.s_per_op
    if (plan.gradient_sync == 'all_reduce' and
        machine.s_per_reduced_var is not None):
      per_var = machine.s_per_reduced_var
    sync += per_var * num_vars * r
  # Splitting the batch into micro-batches and concatenating the outputs.
  split = 2 * plan.num_micro_batches * machine.s_per_op
  loss = profile.loss_ops * r * machine.s_per_op
  plan.step_s = compute + update + sync + split + loss + machine.step_s

  # Memory of each device of one replica.
  per_device = [0.] * spec.num_devices
  last = spec.num_devices - 1
  for d in range(spec.num_devices):
    st_ids = spec.Stages(d)
    weights = sum(stages[s].param_bytes for s in st_ids)
    # Weights, their gradients and the optimizer's slots.
    per_device[d] += weights * (2 + profile.optimizer_slots)
    # A cell's input is kept for its backward pass too (the first cell's is
    # the pipeline's input, counted below).
    boundary = {s: stages[s].in_bytes if s else 0. for s in st_ids}
    if plan.recompute:
      # Boundary inputs of every micro-batch, from 'F' to 'R'; whole
      # activations only between 'R' and 'B'.
      per_device[d] += sum(boundary.values()) * plan.replica_batch
      kept = max(stages[s].kept_bytes for s in st_ids) * mb
    else:
      kept = max(stages[s].kept_bytes + boundary[s] for s in st_ids) * mb
    per_device[d] += tl.PeakInFlight(d) * kept
  # The whole batch enters on the first device and leaves on the last; the
  # output's gradient comes back there.
  per_device[0] += profile.in_bytes * plan.replica_batch
  per_device[last] += 2 * stages[-1].out_bytes * plan.replica_batch
  plan.peak_bytes = max(per_device)
  plan.process_bytes = (r * sum(per_device) + machine.overhead_bytes +
                        GraphOps(profile, plan) * machine.bytes_per_op)
  boundary = sum(st.out_bytes for st in stages[:-1])
  plan.comm_bytes = 2 * boundary * plan.global_batch + sync_bytes
  if spec.num_devices == 1:
    plan.comm_bytes = sync_bytes
  return plan


# Ops per (cell, micro-batch) call of a cell built once: the forward and
# gradient calls, their inputs' and outputs' plumbing and the exported
# operands' rows; enforced actions add their gates and held outputs.
# Measured on lm.TransformerLmTiny's training graph at K = 1, 2 and M = 1,
# 4, 8: 10-18 ops for 'unrolled', 22-28 for '1f1b' and 'zero_bubble' (before
# '1f1b' ran from its lists, which made its graph smaller: L=32 Transformer
# 16585 ops against 21205; tests/test_plan.py checks GraphOps against built
# graphs).
CALL_OPS = {'unrolled': 14}
CALL_OPS_GATED = 26


def GraphOps(profile: ModelProfile, plan: Plan) -> int:
  """Ops of one training step's graph (counted as in ProfileLayers).

  Each cell's forward and backward ops are in the graph once where the
  pipeline builds cells once: Lingvo's 'recurrent' loop, and every other
  schedule with cell functions (`ModelProfile.cell_functions`), which adds
  a call per (cell, micro-batch) (CALL_OPS; recompute calls the same
  forward function again). Cells built inline are copied per micro-batch,
  their forward pass twice with recompute.
  """
  fwd = sum(l.fwd_ops for l in profile.layers)
  bwd = sum(l.bwd_ops for l in profile.layers)
  m = plan.num_micro_batches
  if plan.schedule == 'recurrent':
    per_replica = 2 * fwd + bwd
  elif profile.cell_functions:
    calls = CALL_OPS.get(plan.schedule, CALL_OPS_GATED)
    per_replica = fwd + bwd + plan.num_cells * m * calls
  else:
    per_replica = m * (fwd * (2 if plan.recompute else 1) + bwd)
  num_vars = profile.num_vars
  return plan.replicas * (per_replica + profile.loss_ops) + num_vars * 12


def PredictAll(profile: ModelProfile, plans: Sequence[Plan],
               machine: Machine = Machine()) -> List[Plan]:
  return [Predict(profile, p, machine) for p in plans]


def Rank(plans: Sequence[Plan],
         memory_per_device: Optional[float] = None,
         measured: bool = False) -> List[Plan]:
  """Plans within the budget, fastest first (measured time first if asked).

  Ties (within 0.5%) go to fewer devices, then less memory.

  Raises:
    PlanError: no plan fits the budget; names the least memory that would.
  """
  fits = [p for p in plans
          if memory_per_device is None or p.peak_bytes <= memory_per_device]
  if not fits:
    if not plans:
      raise PlanError('no plan: no (cells, micro-batches, replicas) divides '
                      'the batch; pass another --global_batch.')
    least = min(p.peak_bytes for p in plans)
    raise PlanError(
        '--memory_per_device=%s fits no plan; the smallest that fits one is '
        '%s (pass --memory_per_device=%s or more, or more --devices).' %
        (FormatSize(memory_per_device), FormatSize(least),
         FormatSize(math.ceil(least / 2**20) * 2**20)))

  def Time(p):
    if measured and p.measured_step_s is not None:
      return p.measured_step_s
    return p.step_s

  best = min(Time(p) for p in fits)
  return sorted(fits, key=lambda p: (
      (0 if measured and p.measured_step_s is not None else 1),
      round(math.log(max(Time(p), 1e-12) / max(best, 1e-12)) / 0.005),
      p.devices, p.peak_bytes))


# --measure's significance: a candidate replaces the predicted best only if
# a fair coin would beat it in as many paired rounds with probability at most
# this, over the number of candidates compared (a sign test with Bonferroni's
# correction).
MEASURE_ALPHA = 0.05


def Twin(plan: Plan, plans: Sequence[Plan]) -> Optional[Plan]:
  """The same plan without recompute among `plans`, if `plan` recomputes
  (by choice, not 'recurrent', which always does) and it is there."""
  if not plan.recompute or plan.schedule in ALWAYS_RECOMPUTE:
    return None
  want = dataclasses.replace(plan, recompute=False).Key()
  return next((p for p in plans if p.Key() == want), None)


def MeasuredNoise(plans: Sequence[Plan]) -> float:
  """The relative noise of the measured rounds: the median over plans of
  (median round - fastest round) / fastest round."""
  spreads = []
  for p in plans:
    if p.measured_times:
      fastest = min(p.measured_times)
      mid = sorted(p.measured_times)[(len(p.measured_times) - 1) // 2]
      spreads.append((mid - fastest) / max(fastest, 1e-12))
  spreads.sort()
  return spreads[(len(spreads) - 1) // 2] if spreads else 0.


def SignTestP(wins: int, rounds: int) -> float:
  """P(a fair coin comes up heads in at least `wins` of `rounds` tosses)."""
  return sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2.**rounds


def MinRounds(num_candidates: int, alpha: float = MEASURE_ALPHA) -> int:
  """The fewest paired rounds in which a candidate that wins every round
  beats the predicted best among `num_candidates` (MeasuredChoice)."""
  others = max(num_candidates - 1, 1)
  return max(1, math.ceil(math.log2(others / alpha)))


def MeasuredChoice(candidates: Sequence[Plan],
                   alpha: float = MEASURE_ALPHA) -> Tuple[Plan, float]:
  """The plan --measure picks among measured candidates, and the noise.

  The candidates' `measured_times` are paired rounds: RoundRobin times each
  candidate once per round, so round r of one and of another ran under the
  same load. A candidate is faster than the predicted best (the first
  candidate) if it beat it in so many rounds that a fair coin would with
  probability at most alpha over the number of other candidates (a one-sided
  sign test, Bonferroni-corrected: a gap smaller than the rounds' spread
  counts once it holds round after round, and one lucky round does not).
  Of the predicted best and the candidates faster than it, the one with the
  least fastest round is taken. A recomputing plan runs its twin's steps and
  more: where its twin without recompute was measured, each of its rounds
  counts as no faster than the twin's, and a recomputing pick gives way to
  its twin.

  Args:
    candidates: Measured plans, the predicted best first, each with as many
      rounds.
    alpha: The test's significance over all candidates.

  Returns:
    (the chosen plan, the rounds' relative noise: MeasuredNoise).
  """
  measured = [p for p in candidates if p.measured_times]
  if not measured:
    raise ValueError('MeasuredChoice: no candidate has measured_times.')
  if len({len(p.measured_times) for p in measured}) != 1:
    raise ValueError('MeasuredChoice: the candidates have different numbers '
                     'of rounds; they must be timed in the same rounds.')

  def Rounds(p):
    twin = Twin(p, measured)
    if twin is None:
      return list(p.measured_times)
    return [max(a, b) for a, b in zip(p.measured_times, twin.measured_times)]

  rounds = [Rounds(p) for p in measured]
  base = rounds[0]  # The predicted best's.
  bound = alpha / max(len(measured) - 1, 1)
  faster = [0] + [
      i for i in range(1, len(measured))
      if SignTestP(sum(a < b for a, b in zip(rounds[i], base)),
                   len(base)) <= bound]
  chosen = measured[min(faster, key=lambda i: min(rounds[i]))]
  twin = Twin(chosen, measured)
  if twin is not None:
    chosen = twin
  return chosen, MeasuredNoise(measured)


def Choose(profile: ModelProfile, devices: int,
           memory_per_device: Optional[float] = None,
           global_batch: Optional[int] = None,
           machine: Machine = Machine(), **enumerate_kwargs) -> List[Plan]:
  """The ranked, predicted plans that fit (see Enumerate and Rank)."""
  plans = PredictAll(
      profile, Enumerate(profile, devices, global_batch, **enumerate_kwargs),
      machine)
  return Rank(plans, memory_per_device)


# --- Applying a plan ----------------------------------------------------------


def Overrides(plan: Plan) -> Dict[str, object]:
  """The experiment params the plan sets: key -> value."""
  out = {
      'task.num_partitions': plan.num_cells,
      'task.num_micro_batches': plan.num_micro_batches,
      'task.partition_cost': 'flops',
      'task.schedule': plan.schedule,
      # None lets '1f1b' decide per gradient (schedules.py); the planner
      # only gives it recompute where it must recompute.
      'task.recompute': (None if plan.schedule in ALWAYS_RECOMPUTE +
                         LIST_SCHEDULES else plan.recompute),
      'task.gradient_sync': plan.gradient_sync,
      'input.batch_size': plan.replica_batch,
  }
  return out


def OverrideString(plan: Plan) -> str:
  """The --model_params_override text that runs the plan."""
  items = []
  for key, value in Overrides(plan).items():
    text = '"%s"' % value if isinstance(value, str) else str(value)
    items.append('%s:%s' % (key, text))
  return '; '.join(items)


def TrainerFlags(plan: Plan) -> List[str]:
  """Trainer flags that give the plan its devices (local CPU devices)."""
  return ['--num_cpu_devices=%d' % plan.devices,
          '--worker_split_size=%d' % plan.devices_per_replica]


def Command(model: str, plan: Plan) -> str:
  """The trainer command line that runs the plan."""
  return (".venv/bin/python -m lingvo_ext.trainer --model=%s %s "
          "--model_params_override='%s' --logdir=LOGDIR" %
          (model, ' '.join(TrainerFlags(plan)), OverrideString(plan)))


def ApplyPlan(model_params, plan: Plan):
  """Sets the plan on an experiment's params (`model_registry.GetParams`).

  Args:
    model_params: The experiment's params (with `task` and `input`).
    plan: The plan.

  Returns:
    model_params, changed in place.
  """
  for key, value in Overrides(plan).items():
    node = model_params
    parts = key.split('.')
    for part in parts[:-1]:
      node = node.Get(part)
    node.Set(**{parts[-1]: value})
  return model_params


def Describe(plan: Plan) -> str:
  """One line: the plan and its predicted figures."""
  return ('%s: cut %s, predicted step %.1f ms, bubble %.0f%%, peak %s per '
          'device, %s between devices per step' %
          (plan.Key(), '+'.join(map(str, plan.sizes)), 1e3 * plan.step_s,
           100 * plan.bubble, FormatSize(plan.peak_bytes),
           FormatSize(plan.comm_bytes)))


def Table(plans: Sequence[Plan], limit: int = 20) -> str:
  """A ranked text table of plans."""
  has_measured = any(p.measured_step_s is not None for p in plans)
  head = ['#', 'plan', 'cut', 'step ms', 'bubble', 'peak/device',
          'bytes/step']
  if has_measured:
    head += ['measured ms', 'measured RSS']
  rows = [head]
  for i, p in enumerate(plans[:limit]):
    row = [str(i + 1), p.Key(), '+'.join(map(str, p.sizes)),
           '%.1f' % (1e3 * p.step_s), '%.0f%%' % (100 * p.bubble),
           FormatSize(p.peak_bytes), FormatSize(p.comm_bytes)]
    if has_measured:
      row += ['-' if p.measured_step_s is None else
              '%.1f' % (1e3 * p.measured_step_s),
              '-' if p.measured_rss_bytes is None else
              FormatSize(p.measured_rss_bytes)]
    rows.append(row)
  widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
  lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
           for r in rows]
  if len(plans) > limit:
    lines.append('... and %d more' % (len(plans) - limit))
  return '\n'.join(lines)


# --- Spearman, for the benchmark and tests ------------------------------------


def _Ranks(xs: Sequence[float]) -> List[float]:
  order = sorted(range(len(xs)), key=lambda i: xs[i])
  ranks = [0.] * len(xs)
  i = 0
  while i < len(order):
    j = i
    while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
      j += 1
    for k in range(i, j + 1):
      ranks[order[k]] = (i + j) / 2.
    i = j + 1
  return ranks


def Spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
  """Spearman's rank correlation (average ranks for ties)."""
  if len(xs) != len(ys) or len(xs) < 2:
    raise ValueError('Spearman needs two equal-length lists of >= 2 values.')
  rx, ry = _Ranks(xs), _Ranks(ys)
  mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
  cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
  vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
  vy = math.sqrt(sum((b - my) ** 2 for b in ry))
  return cov / (vx * vy) if vx and vy else 0.


# --- The TensorFlow half (TF) -------------------------------------------------


# Ops that move no data of their own (aliases, constants, checks).
_FREE_OPS = frozenset(['Const', 'Identity', 'IdentityN', 'NoOp', 'Assert',
                       'EnsureShape', 'ReadVariableOp', 'StopGradient',
                       'Placeholder', 'PreventGradient'])


def _IsCounted(op) -> bool:
  """Whether op computes on floats (shape arithmetic is folded away)."""
  return op.type not in _FREE_OPS and any(
      t.dtype.is_floating for t in op.outputs)


def _Source(t):
  """The tensor t aliases through Identity-like ops."""
  while t.op.type in ('Identity', 'EnsureShape', 'StopGradient') and (
      t.op.inputs):
    t = t.op.inputs[0]
  return t


def _LayerGraphStats(p, shapes) -> Tuple[int, int, float]:
  """(forward ops, backward ops, kept bytes) of layer p on inputs of shapes (TF).

  Builds the layer's FProp and its tf.gradients in a throw-away graph (nothing
  runs). Ops are those computing on floats (`_IsCounted`). The kept bytes are
  those of the tensors the layer's forward pass makes (not its inputs or
  weights, through Identity aliases) that its backward ops read: the
  activations a pipeline keeps between a cell's 'F' and its 'B'.
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core import cost  # pylint: disable=g-import-not-at-top
  with cost.Sandbox() as g:
    layer = cost.InstantiateLayer(cost.NamedCopy(p, 'layer'))
    theta = layer.theta.Transform(tf.identity)
    inputs = [tf.identity(t) for t in cost.FakeInputs(p, shapes)]
    n0 = len(g.get_operations())
    outs = layer.FProp(theta, *inputs)
    outs = [o for o in tf.nest.flatten(outs)
            if o is not None and o.dtype.is_floating]
    fwd = g.get_operations()[n0:]
    loss = tf.add_n([tf.reduce_sum(o) for o in outs])
    n1 = len(g.get_operations())
    xs = theta.Flatten() + [x for x in inputs if x.dtype.is_floating]
    tf.gradients(loss, xs)
    bwd = g.get_operations()[n1:]
  fwd_set = set(fwd)
  kept = {}
  for op in bwd:
    for t in op.inputs:
      t = _Source(t)
      if t.op in fwd_set and t.shape.is_fully_defined():
        kept[t.name] = t.shape.num_elements() * t.dtype.size
  return (sum(map(_IsCounted, fwd)), sum(map(_IsCounted, bwd)),
          float(sum(kept.values())))


def ProfileLayers(layer_params: Sequence, *shapes) -> List[LayerProfile]:
  """The LayerProfile of each layer of a sequential stack at `shapes` (TF).

  FLOPs and output shapes from FPropMeta (`cost.LayerMetas`), parameter bytes
  from the layer's variables (`cost.LayerVariables`), op counts and kept
  activation bytes from its graph (built, never run). Identical layers are
  profiled once. All per-example figures divide by the batch of `shapes`.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core import cost  # pylint: disable=g-import-not-at-top
  metas = cost.LayerMetas(layer_params, *shapes)
  batch = int(shapes[0].ToTensorShape().as_list()[0])
  cache = {}
  out = []
  for p, meta in zip(layer_params, metas):
    key = (p.Copy().Set(name='x').ToText(),
           tuple(str(s) for s in meta.in_shapes))
    if key not in cache:
      variables = cost.LayerVariables(p)
      fwd_ops, bwd_ops, kept = _LayerGraphStats(p, meta.in_shapes)
      cache[key] = (
          int(sum(int(np.prod(s)) * d.size for _, s, d in variables)),
          len(variables), fwd_ops, bwd_ops, kept)
    param_bytes, num_vars, fwd_ops, bwd_ops, kept = cache[key]
    out_bytes = cost.ActivationBytes(meta.out_shapes) / batch
    out.append(LayerProfile(
        name=p.name, flops=float(meta.flops) / batch, fwd_ops=fwd_ops,
        bwd_ops=bwd_ops, param_bytes=param_bytes, num_vars=num_vars,
        out_bytes=out_bytes, kept_bytes=max(kept / batch, out_bytes)))
  return out


def OptimizerSlots(task_params) -> int:
  """Slot variables per parameter of the task's optimizer."""
  return OPTIMIZER_SLOTS.get(task_params.train.optimizer.cls.__name__, 2)


def ProfileExperiment(model_params, name: str = '') -> ModelProfile:
  """The ModelProfile of a registered experiment's params (TF).

  Args:
    model_params: `model_registry.GetParams(name, 'Train')` (overrides
      applied), whose task is a `PipelinedTask`.
    name: The experiment's name, for messages.
  """
  task = model_params.task.Copy()
  task.input = model_params.input.Copy()
  stack, shapes = task.cls.LayerStack(task)
  in_shape = shapes[0].ToTensorShape().as_list()
  batch = int(in_shape[0])
  in_bytes = 4. * math.prod(in_shape[1:])  # States between cells: float32.
  return ModelProfile(
      name=name or task.name, layers=tuple(ProfileLayers(stack, *shapes)),
      batch=batch, in_bytes=in_bytes, optimizer_slots=OptimizerSlots(task),
      linear_loss=False,
      cell_functions=bool(task.Get('cell_functions')
                          if 'cell_functions' in task else True))


def ProbeMachine(session_config=None, cores: Optional[float] = None,
                 overhead_bytes: float = 0.) -> Machine:
  """Machine with this host's FLOP rate, per-op time and parallelism (TF).

  Times a chain of small elementwise ops (the per-op cost) and a chain of
  matmuls (the FLOP rate) in a throw-away session, and two such matmul
  chains on two devices at once: how much faster than one after the other
  they run is how many devices compute at once (CPU devices share the
  host's cores, and other processes take their share). The small chain
  again with each op on the other device than the op before it gives the
  time of a hand-off between devices, and gated as the engine gates
  enforced actions the time of a gate; a chain of adds of 1 MB tensors the
  rate of a gradient sum (`Machine.add_bytes_per_s`). A few seconds.

  Args:
    session_config: The tf.ConfigProto the model will run under.
    cores: Devices that compute at once; default: measured as above.
    overhead_bytes: See Machine.
  """
  import statistics  # pylint: disable=g-import-not-at-top
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  n_ops, dim, n_mm = 300, 384, 4
  g = tf.Graph()
  with g.as_default():
    x = tf.Variable(np.ones([8, 8], np.float32))
    y = tf.identity(x)
    for _ in range(n_ops):
      y = tf.tanh(y)  # Nothing for Grappler to fold.
    small = tf.reduce_sum(y)
    empty = tf.reduce_sum(x)
    chains = []
    for d in range(2):
      with tf.device('/cpu:%d' % d):
        a = tf.Variable(
            np.random.RandomState(d).rand(dim, dim).astype(np.float32))
        z = tf.identity(a)
        for _ in range(n_mm):
          z = tf.matmul(z, a) * (1. / dim)
        chains.append(tf.reduce_sum(z))
    big = chains[0]
    both = tf.add_n(chains)
    init = tf.global_variables_initializer()

  def Median(sess, fetch):
    return statistics.median(TimeSteps(lambda: sess.run(fetch), 7, 1))

  # Engine overheads, in a graph Grappler leaves as built (it would fold
  # the hops and gates away, and turn the chain of adds into one AddN): the
  # small chain again, each op on the other device than the one before it
  # (a hand-off, Send/Recv, per op), and each op gated as the list engines
  # gate an action (a NoOp gate waiting for the previous op's completion);
  # and a chain of adds of layer-sized (1 MB) tensors, as gradients are
  # accumulated over micro-batches: the rate of bytes an add moves.
  n_add, add_dim = 20, 512
  g2 = tf.Graph()
  with g2.as_default():
    x2 = tf.Variable(np.ones([8, 8], np.float32))
    y = tf.identity(x2)
    for _ in range(n_ops):
      y = tf.tanh(y)
    plain = tf.reduce_sum(y)
    y = tf.identity(x2)
    for i in range(n_ops):
      with tf.device('/cpu:%d' % (i % 2)):
        y = tf.tanh(y)
    hops = tf.reduce_sum(y)
    y = tf.identity(x2)
    done = None
    for _ in range(n_ops):
      with tf.control_dependencies([done] if done is not None else []):
        gate = tf.no_op()
      with tf.control_dependencies([gate]):
        y = tf.tanh(y)
      done = tf.group(y)
    with tf.control_dependencies([done]):
      gated = tf.reduce_sum(y)
    u = tf.Variable(np.ones([add_dim, add_dim], np.float32))
    v = tf.Variable(np.ones([add_dim, add_dim], np.float32))
    z = tf.identity(u)
    for _ in range(n_add):
      z = z + v
    adds = z[0, 0]
    one_add = (u + v)[0, 0]
    init2 = tf.global_variables_initializer()

  config = tf.config_pb2.ConfigProto()
  if session_config is not None:
    config.CopyFrom(session_config)
  config.device_count['CPU'] = max(2, config.device_count['CPU'])
  config.allow_soft_placement = True
  with tf.Session(graph=g, config=config) as sess:
    sess.run(init)
    base = Median(sess, empty)
    s_per_op = max(Median(sess, small) - base, 1e-7) / n_ops
    one = Median(sess, big)
    two = Median(sess, both)
  raw = tf.config_pb2.ConfigProto()
  raw.CopyFrom(config)
  raw.graph_options.rewrite_options.disable_meta_optimizer = True
  with tf.Session(graph=g2, config=raw) as sess:
    sess.run(init2)
    chain = Median(sess, plain)
    s_per_handoff = max(Median(sess, hops) - chain, 0.) / n_ops
    s_per_gate = max(Median(sess, gated) - chain, 0.) / n_ops
    add_s = max(Median(sess, adds) - Median(sess, one_add), 1e-9) / (
        n_add - 1)
  add_bytes_per_s = 3. * 4 * add_dim**2 / add_s  # Two read, one written.
  mm = max(one - base - n_mm * 2 * s_per_op, 1e-7)
  flops_per_s = n_mm * 2. * dim**3 / mm
  if cores is None:
    cores = min(max(2. * one / max(two, 1e-9), 1.), float(os.cpu_count() or 1))
  return Machine(flops_per_s=flops_per_s, s_per_op=s_per_op, cores=cores,
                 step_s=base, overhead_bytes=overhead_bytes,
                 add_bytes_per_s=add_bytes_per_s, s_per_handoff=s_per_handoff,
                 s_per_gate=s_per_gate)


def ExperimentParams(model: str, dataset: str = 'Train',
                     overrides: str = ''):
  """A registered experiment's params (TF), `overrides` (a
  --model_params_override text) applied; ValueError naming close names."""
  from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
  error = registry.CheckModel(model)
  if error:
    raise ValueError(error)
  return registry.GetParams(model, dataset, overrides)


def SessionConfig(num_devices: int):
  """The trainer's session config (py_utils.SessionConfig), N CPU devices."""
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  config = py_utils.SessionConfig()
  config.device_count['CPU'] = num_devices
  return config


def RssBytes(field: str = 'VmHWM') -> Optional[float]:
  """This process's peak (VmHWM) or current (VmRSS) resident set, bytes."""
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) * 1024.
  except OSError:
    pass
  return None


def BuildExperimentStep(model: str, plan: Plan):
  """(session, train op) of the experiment under `plan` (TF).

  As the trainer builds it: the experiment's params with the plan's
  overrides, its task on a local worker of plan.devices CPU devices split
  into replicas of plan.devices_per_replica, the trainer's session config.
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  py_utils.SetEagerMode(False)
  cfg = ApplyPlan(ExperimentParams(model), plan)
  task_p = cfg.task.Copy()
  task_p.input = cfg.input.Copy()
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=plan.devices,
      split_size=plan.devices_per_replica)
  cluster.params.ps.cpus_per_replica = plan.devices
  graph = tf.Graph()
  with graph.as_default(), cluster:
    tf.random.set_seed(1234)
    py_utils.GetOrCreateGlobalStepVar()
    task = task_p.Instantiate()
    task.FPropDefaultTheta()
    task.BProp()
    train_op = task.train_op
    init = [tf.global_variables_initializer(),
            tf.local_variables_initializer()]
  sess = tf.Session(graph=graph, config=SessionConfig(plan.devices))
  sess.run(init)
  return sess, train_op


def TimeSteps(run, steps: int, warmup: int) -> List[float]:
  """Seconds of `steps` calls of run() after `warmup` untimed ones."""
  import time  # pylint: disable=g-import-not-at-top
  for _ in range(warmup):
    run()
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    run()
    times.append(time.perf_counter() - t)
  return times


def PlanFromDict(d: Dict) -> Plan:
  """The Plan of Plan.ToDict() (extra keys ignored)."""
  fields = {f.name for f in dataclasses.fields(Plan)}
  d = {k: v for k, v in d.items() if k in fields}
  d['sizes'] = tuple(d['sizes'])
  return Plan(**d)


def MeasureJob(job: Dict) -> Dict:
  """One plan's median step seconds and peak RSS bytes (TF; run it in a
  fresh process so that the RSS is the plan's own).

  Args:
    job: model, plan (Plan.ToDict()), steps, warmup.
  """
  import statistics  # pylint: disable=g-import-not-at-top
  plan = PlanFromDict(job['plan'])
  sess, train_op = BuildExperimentStep(job['model'], plan)
  times = TimeSteps(lambda: sess.run(train_op), job['steps'], job['warmup'])
  sess.close()
  return dict(step_s=statistics.median(times), times=times,
              rss_bytes=RssBytes('VmHWM'))


def ReferencePlans(profile: ModelProfile,
                   global_batch: Optional[int] = None,
                   devices: int = 1) -> List[Plan]:
  """The plans Calibrate measures: one cell, one replica, 'unrolled' at M=1
  and at M=8 (or the largest divisor of the batch below it), 'recurrent' at
  M=4 (likewise) and at M=1; with 2 or more devices and an even batch, a
  fifth: 'unrolled' at M=1 over 2 replicas with 'all_reduce'.

  'unrolled''s larger M is 8, not 4: on a host whose devices share its
  cores, two of its micro-batches run at once from M=2 on, so the growth
  from M=1 to 4 mixes that parallelism (predicted only roughly) with the
  cost per micro-batch the fit is after. The longer lever fits the time per
  op where M=4 alone fitted none (bench/plan.py's FC sweep, 2026-11-25:
  its references ran 13.5 ms at M=1 and 9.1 ms at M=4).
  """
  batch = global_batch or profile.batch
  m, m_unrolled = max(_Divisors(batch, 4)), max(_Divisors(batch, 8))
  n = len(profile.layers)
  out = []
  for schedule, mb, rc in (('unrolled', 1, False),
                           ('unrolled', m_unrolled, False),
                           ('recurrent', m, True), ('recurrent', 1, True)):
    out.append(Plan(num_cells=1, sizes=(n,), devices_per_replica=1,
                    num_micro_batches=mb, schedule=schedule, recompute=rc,
                    replicas=1, gradient_sync='shared', global_batch=batch))
  if devices >= 2 and batch % 2 == 0:
    out.append(dataclasses.replace(out[0], replicas=2,
                                   gradient_sync='all_reduce'))
  return out


# Calibrate fits the memory per graph op from its two 'unrolled' references
# only where cells are copied per micro-batch (not `cell_functions`) and the
# larger M adds this share of the smaller one's ops. With cells built once
# the graphs differ by a call per micro-batch (13-55% more ops at M=8 on the
# shipped tiny models, whose cells are a few ops), and the RSS difference is
# the activations' and the allocator's, not the graph's. Then it takes
# DEFAULT_BYTES_PER_OP: what that fit found
# with a copy of each cell per micro-batch counted (`bench/plan.py --rounds 5`
# at 7857fbe, whose sweep was M in {1, 4}, 2026-11-24: 7 KB for
# lm.TransformerLmTiny, 17 KB for image.ConvClassifierTiny, 11 KB for the FC
# benchmark).
MIN_FITTED_OP_GROWTH = 0.25
DEFAULT_BYTES_PER_OP = 12 * 1024.


def _Fit(profile: ModelProfile, plan: Plan, machine: Machine, **fields):
  return Predict(profile, dataclasses.replace(plan),
                 dataclasses.replace(machine, **fields))


def Calibrate(profile: ModelProfile, machine: Machine,
              step_s: Sequence[float],
              rss_bytes: Optional[Sequence[float]] = None,
              refs: Optional[Sequence[Plan]] = None) -> Machine:
  """`machine` fitted to measurements of the ReferencePlans.

  See _CalibrateOneReplica for the first four references. The fifth, over
  two replicas with 'all_reduce', fixes the time per variable and replica
  of its gradients' collectives (`Machine.s_per_reduced_var`): the step's
  time beyond what the other fitted constants predict for it.

  Args:
    profile: The model.
    machine: The probed machine.
    step_s: Measured step seconds of ReferencePlans(profile), in order.
    rss_bytes: Their measured peak RSS (the first two are used), or None.
    refs: The plans measured, if not ReferencePlans(profile) (a saved run's,
      for one).
  """
  refs = list(refs or ReferencePlans(profile, devices=2))
  out = _CalibrateOneReplica(profile, machine, step_s[:4], rss_bytes,
                             refs[:4])
  if len(step_s) > 4:
    ref = refs[4]
    base = _Fit(profile, ref, out, s_per_reduced_var=0.).step_s
    out = dataclasses.replace(out, s_per_reduced_var=max(
        step_s[4] - base, 0.) / max(profile.num_vars * ref.replicas, 1))
  return out


def _CalibrateOneReplica(profile: ModelProfile, machine: Machine,
                         step_s: Sequence[float],
                         rss_bytes: Optional[Sequence[float]],
                         refs: Sequence[Plan]) -> Machine:
  """`machine` fitted to the first four ReferencePlans' measurements.

  The probe's per-op time is that of a chain of tiny ops; a model's graph
  (allocation, several devices, Lingvo's bookkeeping) costs more per op. The
  two 'unrolled' references fix the per-op time (from how the step grows with
  M) and the fixed time of a step; the 'recurrent' ones the time of an op in
  Lingvo's loop (`recurrent_op_factor`, from its one-step M=1 run) and what
  each further step costs per byte of weights (`recurrent_s_per_byte`, from
  the larger M; given only that one, it fits the factor alone). With their
  peak RSS, the two
  'unrolled' ones fix the bytes per graph op (where the larger M's graph is
  larger, cells copied per micro-batch; else DEFAULT_BYTES_PER_OP) and the
  process overhead. Everything else (FLOP rate from the
  probe, schedules, cells, recompute, replicas) stays predicted.

  Args:
    profile: The model.
    machine: The probed machine.
    step_s: Measured step seconds of the first 2-4 ReferencePlans, in order.
    rss_bytes: Their measured peak RSS (the first two are used), or None.
  """
  a, b, c, d = refs[:4]
  zero = dict(s_per_op=0., step_s=0., recurrent_op_factor=1.,
              recurrent_s_per_byte=0., bytes_per_op=0., overhead_bytes=0.)

  def Time(plan, **fields):
    return _Fit(profile, plan, machine, **dict(zero, **fields)).step_s

  fa, fb = Time(a), Time(b)
  oa, ob = Time(a, s_per_op=1.) - fa, Time(b, s_per_op=1.) - fb
  ta, tb = step_s[0], step_s[1]
  s_per_op = machine.s_per_op
  if ob > oa:
    s_per_op = max(((tb - fb) - (ta - fa)) / (ob - oa), machine.s_per_op)
  fixed = ta - fa - s_per_op * oa
  out = dataclasses.replace(machine, s_per_op=s_per_op, step_s=max(fixed, 0.))
  if fixed < 0:
    # The reference ran faster than the probe's FLOP rate allows (the probe
    # is a small matmul, taken under whatever load there was): raise the
    # rate until the FLOPs fit in the time the ops leave.
    flops_s = Time(a) - Time(a, flops_per_s=1e30)
    budget = ta - s_per_op * oa - Time(a, flops_per_s=1e30)
    if flops_s > 0 and budget > 0:
      out = dataclasses.replace(
          out, flops_per_s=machine.flops_per_s * flops_s / budget)
  if len(step_s) > 2:
    # The factor from the one-step run if there is one, else from the
    # larger M (then it carries the further steps' cost too).
    ref, t = (d, step_s[3]) if len(step_s) > 3 else (c, step_s[2])
    p0 = _Fit(profile, ref, out, recurrent_op_factor=0.).step_s
    p1 = _Fit(profile, ref, out, recurrent_op_factor=1.).step_s
    if p1 > p0:
      # Bounded below only: where the fitted per-op time is tiny (a model
      # whose steps are FLOP-bound) the loop's per-step cost is many ops'.
      out = dataclasses.replace(out, recurrent_op_factor=min(
          max((t - p0) / (p1 - p0), 0.05), 1e6))
  if len(step_s) > 3:
    q0 = _Fit(profile, c, out, recurrent_s_per_byte=0.).step_s
    q1 = _Fit(profile, c, out, recurrent_s_per_byte=1e-9).step_s
    per_byte = (step_s[2] - q0) / (q1 - q0) * 1e-9 if q1 > q0 else 0.
    if per_byte > 0:
      out = dataclasses.replace(out, recurrent_s_per_byte=per_byte)
    else:
      # The larger M ran faster than the one step allows (the loop's fixed
      # cost, or noise in the one step): fit the factor on it alone.
      return _CalibrateOneReplica(profile, machine, step_s[:3],
                                  rss_bytes, refs)
  if rss_bytes:
    ma = _Fit(profile, a, out, bytes_per_op=0., overhead_bytes=0.)
    mb = _Fit(profile, b, out, bytes_per_op=0., overhead_bytes=0.)
    ga, gb = GraphOps(profile, a), GraphOps(profile, b)
    per_op = machine.bytes_per_op or DEFAULT_BYTES_PER_OP
    if not profile.cell_functions and gb - ga > MIN_FITTED_OP_GROWTH * ga:
      per_op = max(((rss_bytes[1] - mb.process_bytes) -
                    (rss_bytes[0] - ma.process_bytes)) / (gb - ga), 0.)
    out = dataclasses.replace(
        out, bytes_per_op=per_op,
        overhead_bytes=max(rss_bytes[0] - ma.process_bytes - per_op * ga, 0.))
  return out
