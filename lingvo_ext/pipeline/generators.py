"""Schedule generators: a pipeline's description in, each device's list out.

A generator is a pure-Python function of a `StageSpec` that returns, for
every device, the list of actions it runs (as torch.distributed.pipelining's
`_Action` lists and DeepSpeed's `PipeSchedule.steps()`). Each schedule's
record (records.py) names its generator. Nothing here needs TensorFlow.
"""

import collections
import dataclasses
from typing import List

from lingvo_ext.pipeline.kinds import Action
from lingvo_ext.pipeline.kinds import Kind
from lingvo_ext.pipeline.kinds import ScheduleLists
from lingvo_ext.pipeline.kinds import StageSpec
from lingvo_ext.pipeline.simulate import Deps
from lingvo_ext.pipeline.simulate import UnitCost
from lingvo_ext.pipeline.transforms import FoldOntoDevices
from lingvo_ext.pipeline.transforms import GroupWeightGradients


def _Backward(spec: StageSpec, stage: int, t: int) -> List[Action]:
  if spec.recompute:
    return [Action(Kind.R, stage, t), Action(Kind.B, stage, t)]
  return [Action(Kind.B, stage, t)]


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
    actions = [Action(Kind.F, s, t) for t in range(m) for s in stages]
    if spec.recompute and run == 1:
      for t in range(m):
        for s in reversed(stages):
          actions += [Action(Kind.R, s, t), Action(Kind.B, s, t)]
    elif spec.recompute:
      for first in range(0, m, run):
        group = range(first, min(first + run, m))
        for t in group:
          for s in reversed(stages):
            actions += [Action(Kind.R, s, t), Action(Kind.I, s, t)]
        for s in reversed(stages):
          actions += [Action(Kind.W, s, t) for t in group]
    else:
      for t in range(m):
        actions += [Action(Kind.I, s, t) for s in reversed(stages)]
      for s in reversed(stages):
        actions += [Action(Kind.W, s, t) for t in range(m)]
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
    actions = [Action(Kind.F, d, t) for t in range(warmup)]
    for j in range(m - warmup):
      actions.append(Action(Kind.F, d, warmup + j))
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
      return Action(Kind.F, chunk * dev + d, (i // (dev * v)) * dev + i % dev)

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
    deps = Deps(spec, a, True)
    if spec.recompute and a.kind == 'I':
      deps = [Action(Kind.F, a.stage, a.micro_batch)] + deps[1:]
    return all(dep in end for dep in deps), max(
        [end[dep] for dep in deps if dep in end] + [0.])

  while remaining:
    # The device that can start something soonest goes next.
    best = None
    for d in range(k):
      choices = []
      if next_i[d] < next_f[d]:
        a = Action(Kind.I, d, next_i[d])
        ok, at = Ready(a)
        if ok:
          choices.append((max(at, free[d]), 0, a))
      if next_f[d] < m and next_f[d] - (next_i[d] - len(pending[d])) < k - d:
        a = Action(Kind.F, d, next_f[d])
        ok, at = Ready(a)
        if ok:
          choices.append((max(at, free[d]), 1, a))
      if pending[d]:
        choices.append((free[d], 2, Action(Kind.W, d, pending[d][0])))
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
        out[d].append(Action(Kind.R, d, a.micro_batch))
      out[d].append(a)
    else:
      pending[d].popleft()
      out[d].append(a)
    end[a] = t0 + UnitCost(a) * (2 if spec.recompute and a.kind == 'I'
                                 else 1)
    free[d] = end[a]
    remaining -= 1
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


def ZeroBubbleV(spec: StageSpec) -> ScheduleLists:
  """ZB-V ('zbv'): two stages per device in a V, backward split in 'I', 'W'.

  Device d holds stage d (on the way down) and stage 2D - 1 - d (on the way
  back up), so the last stage sits with the first and a micro-batch's input
  gradient turns at device 0 without waiting for a transfer back. Each
  device warms up with 2(D - d) - 1 forwards of its first stage, then
  alternates the two stages' forward passes, then in steady state runs each
  stage's F, I, W in turn; weight gradients are deferred in the cool-down to
  fill the wait for input gradients (the zero-bubble paper's ZB-V, with the
  1F1B memory of 2D micro-batch stages per device). Needs K even; with more
  than two stages per device, the two-stages-per-device order folded onto
  the devices (`FoldOntoDevices`). With recompute, 'R' before each 'I'.
  One cell: `ZeroBubble`'s lists.
  """
  k, dev, m = spec.num_stages, spec.num_devices, spec.num_micro_batches
  if spec.placement != 'v':
    raise ValueError("zbv: placement=%r; it needs 'v' (actions.Placed)." %
                     (spec.placement,))
  if k == 1:  # One cell: no V to place; ZB-H1's lists of one stage.
    return ZeroBubble(spec)
  if k % 2 or 2 * dev > k:
    raise ValueError(
        'zbv: %d cells on %d devices; it places two cells on each device: '
        'use an even number of cells, at least twice the devices (%d).' %
        (k, dev, 2 * dev))
  if k != 2 * dev:
    virtual = dataclasses.replace(spec, num_devices=k // 2)
    return FoldOntoDevices(virtual, ZeroBubbleV(virtual), spec)
  # Listed as if there were at least 2D - 1 micro-batches (the pipeline's
  # depth), then the ones past M dropped: the order of the rest is the same.
  n = max(m, 2 * dev - 1)
  out = []
  for d in range(dev):
    stages = (d, k - 1 - d)
    done = {kind: [0, 0] for kind in (Kind.F, Kind.I, Kind.W)}
    acts = []

    def Add(kind, chunk, acts=acts, done=done, stages=stages):
      acts.append(Action(kind, stages[chunk], done[kind][chunk]))
      done[kind][chunk] += 1

    for _ in range(2 * (dev - d) - 1):
      Add(Kind.F, 0)
    for _ in range(d):
      Add(Kind.F, 1)
      Add(Kind.F, 0)
    for _ in range(dev - d):
      for kind in (Kind.F, Kind.I, Kind.W):
        Add(kind, 1)
    while done[Kind.F][1] < done[Kind.F][0] or done[Kind.F][0] < n:
      if done[Kind.F][0] < n:
        Add(Kind.F, 0)
      for kind in (Kind.I, Kind.W):
        Add(kind, 0)
      for kind in (Kind.F, Kind.I, Kind.W):
        Add(kind, 1)
    for _ in range(d):
      Add(Kind.I, 0)
      Add(Kind.I, 1)
    for _ in range(dev - d):
      Add(Kind.I, 0)
      Add(Kind.W, 0)
    for chunk in (1, 0):
      while done[Kind.W][chunk] < done[Kind.I][chunk]:
        Add(Kind.W, chunk)
    kept = []
    for a in acts:
      if a.micro_batch < m:
        if spec.recompute and a.kind == Kind.I:
          kept.append(Action(Kind.R, a.stage, a.micro_batch))
        kept.append(a)
    out.append(kept)
  return out
