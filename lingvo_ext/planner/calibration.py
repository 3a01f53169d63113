"""The machine's costs fitted to timed reference plans (pure Python).

`ReferencePlans` are the few plans timed; `Calibrate` fits the probed
`Machine` so that the prediction of each matches its measurement;
`XlaReferencePlans` and `CalibrateXla` do the same for XLA-compiled cells.
"""

import dataclasses
from typing import List
from typing import Optional
from typing import Sequence

from lingvo_ext.pipeline import partitioning
from lingvo_ext.pipeline import records
from lingvo_ext.planner.model_profile import Machine
from lingvo_ext.planner.model_profile import ModelProfile
from lingvo_ext.planner.plans import Divisors
from lingvo_ext.planner.plans import Plan
from lingvo_ext.planner.prediction import GraphOps
from lingvo_ext.planner.prediction import Predict


def ReferencePlans(profile: ModelProfile,
                   global_batch: Optional[int] = None,
                   devices: int = 1) -> List[Plan]:
  """The plans Calibrate measures: one cell, one replica, 'unrolled' at M=1
  and at M=8 (or the largest divisor of the batch below it), 'recurrent' at
  M=4 (likewise) and at M=1; with 2 or more devices and an even batch, a
  fifth: 'unrolled' at M=1 over 2 replicas with 'all_reduce'; last, for an
  even batch, 'unrolled' at M=1 on half the batch.

  'unrolled''s larger M is 8, not 4: on a host whose devices share its
  cores, two of its micro-batches run at once from M=2 on, so the growth
  from M=1 to 4 mixes that parallelism (predicted only roughly) with the
  cost per micro-batch the fit is after. The longer lever fits the time per
  op where M=4 alone can fit none (on bench/plan.py's FC model the step at
  M=4 is shorter than at M=1). The half batch tells the fixed time of a
  step from the time that grows with the batch: at one batch size they move
  together (at batch 512 a fit without it put most of a step on its fixed
  time, which 2 devices do not share, and predicted 2 cells 48% slow).
  """
  batch = global_batch or profile.batch
  m, m_unrolled = max(Divisors(batch, 4)), max(Divisors(batch, 8))
  n = len(profile.layers)
  out = []
  for schedule, mb, rc in (('unrolled', 1, False),
                           ('unrolled', m_unrolled, False),
                           (records.LINGVO_ENGINE, m, True),
                           (records.LINGVO_ENGINE, 1, True)):
    out.append(Plan(num_cells=1, sizes=(n,), devices_per_replica=1,
                    num_micro_batches=mb, schedule=schedule, recompute=rc,
                    replicas=1, gradient_sync='shared', global_batch=batch))
  if devices >= 2 and batch % 2 == 0:
    out.append(dataclasses.replace(out[0], replicas=2,
                                   gradient_sync='all_reduce'))
  if batch % 2 == 0:
    out.append(dataclasses.replace(out[0], global_batch=batch // 2))
  return out


# Calibrate fits the memory per graph op from its two 'unrolled' references
# only where cells are copied per micro-batch (not `cell_functions`) and the
# larger M adds this share of the smaller one's ops. With cells built once
# the graphs differ by a call per micro-batch (13-55% more ops at M=8 on the
# shipped tiny models, whose cells are a few ops), and the RSS difference is
# the activations' and the allocator's, not the graph's. Then it takes
# DEFAULT_BYTES_PER_OP: about what that fit finds with a copy of each cell per
# micro-batch counted (`bench/plan.py` over lm.TransformerLmTiny,
# image.ConvClassifierTiny and the FC benchmark), so an uncalibrated plan
# still charges each op its graph memory.
MIN_FITTED_OP_GROWTH = 0.25
DEFAULT_BYTES_PER_OP = 12 * 1024.


def _Fit(profile: ModelProfile, plan: Plan, machine: Machine, **fields):
  return Predict(profile, plan, dataclasses.replace(machine, **fields))


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
    refs: The plans measured, if not ReferencePlans(profile, devices=2)
      (a saved run's, for one).
  """
  refs = list(refs or ReferencePlans(profile, devices=2))
  timed = list(zip(refs, step_s))
  full = [x for x in timed if x[0].global_batch == refs[0].global_batch]
  half = [x for x in timed if x[0].global_batch < refs[0].global_batch]
  one = [x for x in full if x[0].replicas == 1][:4]
  out = _CalibrateOneReplica(profile, machine, [t for _, t in one],
                             rss_bytes, [r for r, _ in one],
                             half[0] if half else None)
  for ref, t in full[len(one):len(one) + 1]:
    base = _Fit(profile, ref, out, s_per_reduced_var=0.).step_s
    out = dataclasses.replace(out, s_per_reduced_var=max(
        t - base, 0.) / max(profile.num_vars * ref.replicas, 1))
  return out


def _CalibrateOneReplica(profile: ModelProfile, machine: Machine,
                         step_s: Sequence[float],
                         rss_bytes: Optional[Sequence[float]],
                         refs: Sequence[Plan], half=None) -> Machine:
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
  process overhead. With `half` ((plan, seconds): 'unrolled' at M=1 on half
  the batch) the three 'unrolled' steps fit the per-op time, the fixed time
  and the FLOP rate together (_FitWithHalfBatch); without it the FLOP rate
  is the probe's. Everything else (schedules, cells, recompute, replicas)
  stays predicted.

  Args:
    profile: The model.
    machine: The probed machine.
    step_s: Measured step seconds of the first 2-4 ReferencePlans, in order.
    rss_bytes: Their measured peak RSS (the first two are used), or None.
  """
  a, b = refs[:2]
  c, d = (list(refs[2:4]) + [None, None])[:2]
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
  fitted = half and _FitWithHalfBatch(profile, machine, (a, ta), (b, tb),
                                      half, zero)
  if fitted:
    out = fitted
  elif fixed < 0:
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
                                  rss_bytes, refs, half)
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


def _FitWithHalfBatch(profile: ModelProfile, machine: Machine, a, b, h,
                      zero) -> Optional[Machine]:
  """`machine` with the per-op time, fixed time and FLOP rate solved from
  three 'unrolled' (plan, seconds): M=1, the larger M, M=1 on half the batch.

  Each step is linear in the three (one device: one chain of actions, or
  the whole work over the cores): step = c + fixed + s_per_op x ops +
  FLOPs / rate. Out of bounds (timing noise: a negative fixed time, a
  per-op time below the probe's), the constant out of bounds is held at its
  bound and the others solved again: the probe's per-op time, then a fixed
  time of 0, then both (the rate fitted to the two M=1 steps). None where
  even that gives a rate beyond 50x the probe's either way.
  """
  rate0, s0 = machine.flops_per_s, machine.s_per_op

  def Time(plan, **fields):
    return _Fit(profile, plan, machine, **dict(zero, **fields)).step_s

  rows, rhs = [], []
  for plan, t in (a, b, h):
    c = Time(plan, flops_per_s=1e30)
    ops = (Time(plan, s_per_op=1e-6, flops_per_s=1e30) - c) / 1e-6
    flops = (Time(plan, flops_per_s=rate0) - c) * rate0
    rows.append([1., ops, flops])
    rhs.append(t - c)

  def Valid(fixed, s_per_op, inverse):
    return (fixed >= 0 and s_per_op >= s0 and
            1. / (50 * rate0) <= inverse <= 50. / rate0)

  def Held(fixed=None, s_per_op=None, use=(0, 1, 2)):
    # Solves the free constants over the references `use` (as many).
    free = [i for i, v in enumerate((fixed, s_per_op)) if v is None] + [2]
    held = {0: fixed, 1: s_per_op}
    eqs = [([rows[r][i] for i in free],
            rhs[r] - sum(rows[r][i] * v for i, v in held.items()
                         if v is not None)) for r in use]
    if len(free) == 1:  # The rate alone: least squares.
      num = sum(x[0] * y for x, y in eqs)
      den = sum(x[0] * x[0] for x, _ in eqs)
      x = [num / den] if den > 0 else None
    else:
      x = _Solve([e[0] for e in eqs], [e[1] for e in eqs])
    if not x:
      return None
    got = dict(held)
    got.update(zip(free, x))
    return [got[0], got[1], got[2]]

  for x in (Held(), Held(s_per_op=s0, use=(0, 2)),
            Held(fixed=0., use=(0, 1)), Held(fixed=0., s_per_op=s0,
                                             use=(0, 2))):
    if x and Valid(*x):
      fixed, s_per_op, inverse = x
      return dataclasses.replace(machine, s_per_op=s_per_op, step_s=fixed,
                                 flops_per_s=1. / inverse)
  return None


# Bounds of the fitted XLA FLOP rate over TensorFlow's: beyond them a fit
# says more about the timing's noise than about XLA's kernels.
XLA_FLOP_FACTOR_RANGE = (0.05, 20.)


def XlaReferencePlans(profile: ModelProfile,
                      global_batch: Optional[int] = None,
                      devices: int = 1) -> List[Plan]:
  """The plans CalibrateXla measures: ReferencePlans' two 'unrolled' ones
  (one cell, M=1 and the larger M) with jit_compile True; with 2 or more
  devices and layers, a third: the larger M over two cells on two devices.
  """
  refs = [dataclasses.replace(p, jit_compile=True)
          for p in ReferencePlans(profile, global_batch)[:2]]
  if devices >= 2 and len(profile.layers) >= 2:
    sizes = tuple(partitioning.MinMaxPartition(
        [l.flops for l in profile.layers], 2))
    refs.append(dataclasses.replace(refs[1], num_cells=2, sizes=sizes,
                                    devices_per_replica=2))
  return refs


def _Solve(rows: Sequence[Sequence[float]],
           rhs: Sequence[float]) -> Optional[List[float]]:
  """x with rows . x = rhs (Gaussian elimination); None if singular."""
  n = len(rhs)
  a = [list(r) + [b] for r, b in zip(rows, rhs)]
  for c in range(n):
    pivot = max(range(c, n), key=lambda r: abs(a[r][c]))
    scale = max(abs(v) for row in a for v in row[:n]) or 1.
    if abs(a[pivot][c]) < 1e-12 * scale:
      return None
    a[c], a[pivot] = a[pivot], a[c]
    for r in range(n):
      if r != c:
        f = a[r][c] / a[c][c]
        a[r] = [x - f * y for x, y in zip(a[r], a[c])]
  return [a[r][n] / a[r][r] for r in range(n)]


def CalibrateXla(profile: ModelProfile, machine: Machine,
                 step_s: Sequence[float],
                 refs: Optional[Sequence[Plan]] = None) -> Machine:
  """`machine` (Calibrate's) with XLA's costs fitted to XlaReferencePlans.

  The one-cell references run the same FLOPs in 2 and 2M compiled calls (a
  forward and a backward per micro-batch), so the step's growth with M fixes
  the time of a call and its level the FLOP rate
  (`Machine.xla_flop_factor`). The two-cell reference, where given, makes
  twice the calls over the same weights, which tells the time per call
  (`xla_s_per_call`) from the time per byte of the cell's weights per call
  (`xla_s_per_param_byte`); without it that is 0. A fit out of bounds
  (noise: a negative time, a factor outside XLA_FLOP_FACTOR_RANGE) falls
  back to fewer constants: no time per byte, then no time per call and the
  factor bounded.

  Args:
    profile: The model.
    machine: Calibrate's machine.
    step_s: Measured step seconds of the references, in order.
    refs: The plans measured, if not XlaReferencePlans(profile) (whose
      length is that of `step_s`: 2, or 3 with the two-cell one).
  """
  refs = list(refs or XlaReferencePlans(
      profile, devices=2 if len(step_s) > 2 else 1))[:len(step_s)]
  lo, hi = XLA_FLOP_FACTOR_RANGE
  unit = machine.XlaSecondsPerCall() or 1e-5
  per_byte_unit = unit / max(profile.param_bytes, 1)

  def Time(plan, call=0., per_byte=0., factor=1e30):
    return _Fit(profile, plan, machine, xla_s_per_call=call,
                xla_s_per_param_byte=per_byte,
                xla_flop_factor=factor).step_s

  # Each step as base + call * calls + per_byte * bytes + flops / factor
  # (linear in the three).
  base = [Time(p) for p in refs]
  calls = [(Time(p, call=unit) - t0) / unit for p, t0 in zip(refs, base)]
  nbytes = [(Time(p, per_byte=per_byte_unit) - t0) / per_byte_unit
            for p, t0 in zip(refs, base)]
  flops = [Time(p, factor=1.) - t0 for p, t0 in zip(refs, base)]
  left = [t - t0 for t, t0 in zip(step_s, base)]

  def Valid(call, per_byte, inverse):
    # Within rounding of 0 is 0.
    return (call >= -1e-6 * unit and per_byte >= -1e-6 * per_byte_unit and
            1. / hi <= inverse <= 1. / lo)

  if len(refs) > 2:
    x = _Solve([list(r) for r in zip(calls, nbytes, flops)], left[:3])
    if x and Valid(*x):
      return dataclasses.replace(machine, xla_s_per_call=max(x[0], 0.),
                                 xla_s_per_param_byte=max(x[1], 0.),
                                 xla_flop_factor=1. / x[2])
  x = _Solve([[calls[0], flops[0]], [calls[1], flops[1]]], left[:2])
  if x and Valid(x[0], 0., x[1]):
    call, inverse = max(x[0], 0.), x[1]
  else:
    # The call time at 0 (or as solved, if not negative), the factor fitted
    # to the M=1 step and bounded, then the call time to what that leaves.
    call = max(x[0], 0.) if x else 0.
    inverse = (left[0] - call * calls[0]) / max(flops[0], 1e-30)
    inverse = min(max(inverse, 1. / hi), 1. / lo)
    call = max((left[0] - inverse * flops[0]) / max(calls[0], 1e-30), 0.)
  return dataclasses.replace(machine, xla_s_per_call=call,
                             xla_s_per_param_byte=0.,
                             xla_flop_factor=1. / inverse)
