"""The prediction of a plan's step time, memory and bytes (pure Python).

Given a model's per-layer profile (`ModelProfile`: forward FLOPs, op counts,
parameter bytes and the activation bytes each layer keeps for its backward
pass, per example) and N devices, `Enumerate` lists every plan

  K cells (cut by the exact min-max FLOPs cut, as `PartitionSequentialLayers`
  cuts them), D devices per replica (D = K, or K / V for 'interleaved_1f1b',
  and K / 2 for 'zero_bubble' too),
  M micro-batches, a schedule of `schedules.SCHEDULES`, recompute, R
  data-parallel replicas with D * R <= N, and a gradient_sync strategy,

and `Predict` gives, for each, the step time and the peak memory per device
from the schedule's own action lists (`records.Build`) simulated over the
per-stage costs (`simulate.Simulate`):

- Action cost: ops x seconds per op + FLOPs / FLOP rate (`Machine`), for the
  stage's layers at the micro-batch size; a backward pass is 2x the forward
  FLOPs and its own op count; 'R' is a forward pass again. An XLA-compiled
  cell (jit_compile True) pays one call (`Machine.xla_s_per_call`, and
  `xla_s_per_param_byte` of its weights) for its ops, and its FLOPs at XLA's
  rate (`Machine.xla_flop_factor`). What the
  engines add: a hand-off (`Machine.s_per_handoff` and the bytes) for each tensor an
  action receives from another device, a gate (`Machine.s_per_gate`) per
  enforced action (`GatedKinds`, `records.ORDERED_KINDS`), and the sums of
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
actions first (`transforms.ForwardsFirst`), which is what is simulated.
"""

import dataclasses
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo_ext.pipeline import kinds
from lingvo_ext.pipeline import records
from lingvo_ext.pipeline import runs
from lingvo_ext.pipeline import simulate
from lingvo_ext.pipeline import transforms
from lingvo_ext.planner.model_profile import Machine
from lingvo_ext.planner.model_profile import ModelProfile
from lingvo_ext.planner.plans import Candidate
from lingvo_ext.planner.plans import Plan
from lingvo_ext.planner.plans import Prediction

# Op times per variable per replica that a step spends synchronising
# gradients, beyond the bytes: none for 'shared' (the replicas read one copy
# and tf.gradients sums their gradients in the backward pass it builds
# anyway); a collective's rendezvous and its plumbing for 'all_reduce',
# which make its step slower than 'shared''s on this project's models. The
# values are those that rank bench/plan.py's sweeps best (by Spearman's rank
# correlation of predicted and measured step times).
SYNC_OPS_PER_VAR = {'shared': 0, 'all_reduce': 6}


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
  (`kinds.StageSpec.weight_gradient_run`).

  `runs.WeightGradientRunLength`, as the engine, with the stages' kept
  activations standing in for the MatMul operands. 1 for other plans.
  """
  if (plan.schedule,
      bool(plan.recompute)) not in records.SIZED_WEIGHT_GRADIENT_RUNS:
    return 1
  mb = plan.replica_batch // plan.num_micro_batches
  return runs.WeightGradientRunLength(
      sum(st.param_bytes for st in stages),
      sum(st.kept_bytes for st in stages) * mb, plan.num_micro_batches)


def _InLoop(plan: Plan) -> bool:
  """Whether the plan's schedule runs as Lingvo's loop, not action lists."""
  return records.Get(plan.schedule).planner.lingvo_loop


def ActionSchedule(plan: Plan, linear_loss: bool = True,
                   weight_gradient_run: int = 1
                  ) -> Tuple[kinds.StageSpec, List]:
  """The plan's action lists, as its engine runs them: the schedule's own
  (GPipe's for 'recurrent', whose loop runs all forward passes first); for a
  loss not linear in the outputs, forward actions first. `weight_gradient_run`
  is `WeightGradientRun`'s."""
  name = records.Get(plan.schedule).planner.simulated_as or plan.schedule
  spec = records.Placed(name, kinds.StageSpec(
      plan.num_cells, plan.devices_per_replica, plan.num_micro_batches,
      recompute=plan.recompute, weight_gradient_run=weight_gradient_run))
  schedule = records.Build(name, spec)
  if not linear_loss:  # GPipe's lists are in that order already.
    schedule = transforms.ForwardsFirst(schedule)
  return spec, schedule


def GatedKinds(plan: Plan) -> Tuple[str, ...]:
  """Action kinds the plan's engine gates (holds behind a NoOp that waits
  for the action before it): `records.ORDERED_KINDS`, none for
  'recurrent'."""
  return tuple(records.ORDERED_KINDS.get(plan.schedule, ()))


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
  if _InLoop(plan):
    return m + k - 2
  _, schedule = ActionSchedule(plan, weight_gradient_run=weight_gradient_run)
  return len(SummingActions(plan, schedule)) // k


def AccumulateSeconds(stage: _Stage, machine: Machine,
                      s_per_op: float) -> float:
  """One sum of a stage's weight gradients into their running sums: an add
  per variable, reading two and writing one of its bytes."""
  return (stage.num_vars * s_per_op +
          3. * stage.param_bytes / machine.add_bytes_per_s)


def HandoffBytes(stages: Sequence[_Stage], spec: kinds.StageSpec,
                 a: kinds.Action, micro_batch: int) -> Optional[float]:
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
           s_per_op: float, spec: Optional[kinds.StageSpec] = None,
           gated: Sequence[str] = (), summing=frozenset(), xla: bool = False):
  """Action -> seconds for the stages at `micro_batch` examples: compute,
  plus with `spec` the hand-off of what it receives from another device,
  plus a gate if its kind is `gated`, plus a sum of the stage's weight
  gradients if it is in `summing`. With `xla` a cell's pass is one compiled
  call (`Machine.xla_s_per_call`) and its FLOPs at XLA's rate."""
  rate = machine.flops_per_s
  if xla:
    rate *= machine.xla_flop_factor

  def Cost(a: kinds.Action) -> float:
    st = stages[a.stage]
    if xla:
      fwd_fixed = bwd_fixed = machine.XlaSecondsPerCall() + (
          machine.xla_s_per_param_byte * st.param_bytes)
    else:
      fwd_fixed, bwd_fixed = st.fwd_ops * s_per_op, st.bwd_ops * s_per_op
    fwd = fwd_fixed + st.flops * micro_batch / rate
    bwd = bwd_fixed + 2 * st.flops * micro_batch / rate
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
  (`runs.WeightGradientRuns`), but a stage's first, in its device's
  order."""
  if _InLoop(plan):
    return frozenset()
  by_first = {run[0]: run for run in runs.WeightGradientRuns(schedule)}
  out, seen = set(), set()
  for acts in schedule:
    for a in acts:
      if a.kind == 'B' or a in by_first:
        last = by_first[a][-1] if a in by_first else a
        if a.stage in seen:
          out.add(last)
        seen.add(a.stage)
  return frozenset(out)


def _RecurrentCompute(stages: Sequence[_Stage], spec: kinds.StageSpec,
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
  fwd = [cost(kinds.Action('F', s, 0)) for s in range(len(stages))]
  bwd = [cost(kinds.Action('R', s, 0)) + cost(kinds.Action('B', s, 0))
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


def Xla(plan: Plan) -> bool:
  """Whether the plan's cells are XLA-compiled (Lingvo's loop never is)."""
  return plan.jit_compile is True and not _InLoop(plan)


def Predict(profile: ModelProfile, plan: Plan,
            machine: Machine = Machine()) -> Prediction:
  """The plan's predicted step time, bubble, memory and bytes.

  jit_compile 'auto' (the faster build, timed before the model is built) is
  predicted as the faster of False and True where XLA is calibrated
  (`Machine.xla_s_per_call` set), else as False.
  """
  if (plan.jit_compile == 'auto' and machine.xla_s_per_call is not None and
      not _InLoop(plan)):
    return min((_Predict(profile, dataclasses.replace(plan, jit_compile=jit),
                         machine) for jit in (False, True)),
               key=lambda p: p.step_s)
  return _Predict(profile, plan, machine)


def _Predict(profile: ModelProfile, plan: Plan,
             machine: Machine) -> Prediction:
  """Predict, for a plan built with jit_compile as it says."""
  stages = Stages(profile, plan.sizes)
  mb = plan.replica_batch // plan.num_micro_batches
  spec, schedule = ActionSchedule(plan, profile.linear_loss,
                                  WeightGradientRun(plan, stages))
  s_per_op = machine.s_per_op
  if _InLoop(plan):
    s_per_op *= machine.recurrent_op_factor
  gated = GatedKinds(plan)
  cost = _Costs(stages, mb, machine, s_per_op, spec, gated,
                SummingActions(plan, schedule), xla=Xla(plan))
  tl = simulate.Simulate(spec, schedule, cost)
  r = plan.replicas
  if _InLoop(plan):
    makespan, busy, useful = _RecurrentCompute(
        stages, spec, cost,
        [AccumulateSeconds(st, machine, s_per_op) for st in stages],
        machine.recurrent_s_per_byte)
    bubble = 1. - useful / (makespan * spec.num_devices)
  else:
    makespan = tl.makespan
    busy = sum(tl.end[a] - tl.start[a] for a in tl.start)
    bubble = tl.IdleFraction()
  parallel = machine.Parallel(plan.devices)
  if machine.cores is not None and not _InLoop(plan) and not any(
      a.kind in gated for acts in schedule for a in acts):
    # Nothing holds the actions to their lists, and the devices share the
    # host's cores: TensorFlow's executor runs whatever is ready, several
    # actions of one device at once (one cell over two micro-batches keeps
    # two cores busy).
    makespan = simulate.CriticalPath(spec, schedule, cost)
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
  step_s = compute + update + sync + split + loss + machine.step_s

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
  process_bytes = (r * sum(per_device) + machine.overhead_bytes +
                   GraphOps(profile, plan) * machine.bytes_per_op)
  boundary = sum(st.out_bytes for st in stages[:-1])
  comm_bytes = 2 * boundary * plan.global_batch + sync_bytes
  if spec.num_devices == 1:
    comm_bytes = sync_bytes
  return Prediction(step_s=step_s, bubble=bubble, peak_bytes=max(per_device),
                    process_bytes=process_bytes, comm_bytes=comm_bytes)


# Ops per (cell, micro-batch) call of a cell built once: the forward and
# gradient calls, their inputs' and outputs' plumbing and the exported
# operands' rows; enforced actions add their gates and held outputs. The
# engine shares one zero per (device, dtype, shape) among gradient-less call
# outputs and reads the micro-batch steps as one vector, so 'unrolled' adds
# few ops per call beyond the calls (tests/planner/test_tf_profiling.py
# checks GraphOps against built graphs; figures in docs/benchmarks.md).
CALL_OPS = {'unrolled': 5}
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
  if _InLoop(plan):
    per_replica = 2 * fwd + bwd
  elif profile.cell_functions:
    calls = CALL_OPS.get(plan.schedule, CALL_OPS_GATED)
    per_replica = fwd + bwd + plan.num_cells * m * calls
  else:
    per_replica = m * (fwd * (2 if plan.recompute else 1) + bwd)
  num_vars = profile.num_vars
  return plan.replicas * (per_replica + profile.loss_ops) + num_vars * 12


def PredictAll(profile: ModelProfile, plans: Sequence[Plan],
               machine: Machine = Machine()) -> List[Candidate]:
  """Each plan with its prediction."""
  return [Candidate(p, Predict(profile, p, machine)) for p in plans]
