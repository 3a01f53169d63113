"""The interpreter: builds a schedule's per-device action lists as a graph.

It walks the actions in an order the data allows (`_WalkOrder`: the lists
simulated over unit costs, each device's list in its order) and calls one
method per action kind: `F`, `R`, `I`, `B`, `W`. Each builds the action's
ops on its cell's device behind a gate (a NoOp its ops wait for) and makes
its completion (an op that runs once its ops, and the running sums they
add to, have).

The schedule's record says which kinds' places are enforced
(`records.Schedule.ordered`): such an action's gate waits for the
completions of the actions before it on its device (`_Wire`, `runs.Waits`),
so those run in list order. The other actions run as soon as their inputs
are there, in whatever order TensorFlow's executor picks: on purpose, so
that where devices share cores (CPU devices of one process) the executor
fills a core one device leaves idle with another's work.

The forward actions ('F') are built when the layer's FProp runs; the
backward ones inside the pipeline's custom gradient (custom_gradient.py),
when tf.gradients builds the backward pass: only then is the caller's loss
known, which decides, per the record, recomputation and whether each
device's forward actions go first (loss.py).

With `check_numerics='step'` the cells are built without Lingvo's numeric
checks (`cell_function.CellChecks`) and the pipeline checks, once a step, its
outputs (and so, by CheckNumerics' gradient, their gradients) and its inputs'
gradients; Lingvo's learner checks every weight's gradient once a step.
"""

import contextlib
from typing import Optional

import lingvo.compat as tf

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.layers import sharding
from lingvo_ext.pipeline import cell_function
from lingvo_ext.pipeline import gemm_rewrite
from lingvo_ext.pipeline import loss
from lingvo_ext.pipeline import matmul_grad
from lingvo_ext.pipeline import records
from lingvo_ext.pipeline import runs
from lingvo_ext.pipeline.custom_gradient import WithBackward
from lingvo_ext.pipeline.kinds import Action
from lingvo_ext.pipeline.kinds import Kind
from lingvo_ext.pipeline.kinds import StageSpec
from lingvo_ext.pipeline.nest_util import Flat
from lingvo_ext.pipeline.nest_util import ToTuple
from lingvo_ext.pipeline.randomness import CellRandomness
from lingvo_ext.pipeline.simulate import Simulate
from lingvo_ext.pipeline.tensors import CastHere
from lingvo_ext.pipeline.tensors import Checked
from lingvo_ext.pipeline.tensors import ConcatGrads
from lingvo_ext.pipeline.tensors import Group
from lingvo_ext.pipeline.tensors import IsFloat
from lingvo_ext.pipeline.tensors import SplitGrads
from lingvo_ext.pipeline.weight_gradients import CellWeightGradients
from lingvo_ext.pipeline.weight_gradients import RunLength


def _WalkOrder(spec: StageSpec, schedule):
  """Every action, each after the actions whose outputs it reads: by start
  time when the lists are simulated over unit costs (an action starts after
  its inputs end), each device's actions in its list's order."""
  timeline = Simulate(spec, schedule)
  return sorted((a for acts in schedule for a in acts),
                key=lambda a: (timeline.start[a], spec.Device(a.stage)))


class Interpreter:
  """Builds one pipeline's forward and backward passes from its lists.

  Args (of the constructor):
    layer: The `gpipe.PipeliningLayer`.
    theta: Its weights.
    inputs: The cells' inputs (after the layer's `before_tpl` layers).
    num_micro: M.
    schedule_name: The record's name.
    recompute: The layer's `recompute` (None: the record's default).
  """

  def __init__(self, layer, theta, inputs, num_micro: int,
               schedule_name: str, recompute: Optional[bool]):
    self.layer = layer
    self.p = layer.params
    self.cells = layer.Cells()
    self.devices = layer.Devices()
    self.num_micro = num_micro
    self.record = records.Get(schedule_name)
    self.recompute = recompute
    self.inputs = inputs
    self.theta = theta
    self.ordered = tuple(self.record.ordered)
    # 'cells': Lingvo's checks in every (cell, micro-batch); 'step': once.
    self.cell_checks = getattr(self.p, 'check_numerics', 'cells') == 'cells'
    self.num_devices = len(set(self.devices))
    # Checked now, so a bad (K, M) fails at FProp, not in tf.gradients; the
    # forward actions are walked in these lists' order.
    self.forward_lists = records.Build(schedule_name,
                                       self._Spec(bool(recompute)))
    # Per cell, its function (None: built inline), found or made at its
    # first forward action (cell_function.ForCell).
    self.cell_fns = [None] * len(self.cells)
    self.fn_jit = [None] * len(self.cells)  # None: no function wanted.
    jit = layer.JitCompile()
    if getattr(self.p, 'cell_functions', False) or jit:
      for i, (name, _) in enumerate(self.cells):
        if any(sharding.IsShard(v) for v in theta[name].Flatten()):
          # A partitioned variable's shards are read where they live (see
          # Build); a function would read each one onto the cell's device.
          tf.logging.info('%s: cell %s holds variable shards; built inline.',
                          self.p.name, name)
          continue
        self.fn_jit[i] = jit

  def _Spec(self, recompute: bool, run: int = 1) -> StageSpec:
    return records.Placed(self.record.name, StageSpec(
        len(self.cells), self.num_devices, self.num_micro, recompute, run))

  def _WeightGradientRun(self) -> int:
    """How many micro-batches a run of 'W's takes where the record sizes
    runs (`weight_gradients.RunLength`)."""
    return RunLength([Flat(outs[0]) for outs in self.cell_out],
                     self.num_micro)

  # --- The forward pass --------------------------------------------------------

  def _CellFProp(self, i, x, step, scope, gate=False):
    """Cell i on micro-batch input x, in a fresh name scope `scope`.

    With `gate`, every op of the cell waits for a NoOp 'fwd_gate' (returned
    second), which the action before it on its device holds back.
    """
    _, cell = self.cells[i]
    fn = self.cell_fns[i]
    with contextlib.ExitStack() as scoped:
      if fn is not None:
        # One traced function per cell; this is one call of it.
        call = lambda: fn(self.thetas[i], ToTuple(x), step)
        scoped.enter_context(tf.name_scope(scope))
      else:
        scoped.enter_context(cell_function.CellChecks(self.cell_checks))
        call = lambda: gemm_rewrite.Flattened(
            lambda: cell.FProp(self.thetas[i], *ToTuple(x)),
            getattr(self.p, 'flat_weight_matmuls', True))
        scoped.enter_context(matmul_grad.PipelineMatMulGradients())
        scoped.enter_context(CellRandomness(step, scope))
      if not gate:
        return ToTuple(call()), None
      gate_op = tf.no_op(name='fwd_gate')
      with tf.control_dependencies([gate_op]):
        return ToTuple(call()), gate_op

  def F(self, a: Action):
    """Cell i's forward pass of micro-batch t, on its device, in scope
    '<cell>_mb<t>', with Lingvo's random seeds of the micro-batch."""
    i, t = a.stage, a.micro_batch
    name, cell = self.cells[i]
    x = self.x0[t] if i == 0 else self.cell_out[i - 1][t]
    with tf.device(self.devices[i]):
      if t == 0 and self.fn_jit[i] is not None:
        self.cell_fns[i] = cell_function.ForCell(
            cell, '%s_fprop' % name, self.fn_jit[i], self.thetas[i], x,
            self.steps[t], getattr(self.p, 'flat_weight_matmuls', True),
            self.cell_checks)
        if self.cell_fns[i].HasUnexportedLookups(self.thetas[i], x,
                                                 self.steps[t]):
          # A lookup the function does not export (another axis,
          # batch_dims): its gradient stays sparse inline.
          tf.logging.info('%s: cell %s gathers from a weight other than '
                          'by rows; built inline.', self.p.name, name)
          self.cell_fns[i] = None
      if self.cell_fns[i] is not None:
        # A function call's inputs are Identities: tf.gradients stops
        # there, not at the previous cell's call op (for which it would
        # build a dead SymbolicGradient).
        x = tf.nest.pack_sequence_as(
            x, [None if v is None else tf.identity(v) for v in Flat(x)])
      self.cell_in[i][t] = x
      self.cell_out[i][t], self.fwd_gates[a] = self._CellFProp(
          i, x, self.steps[t], '%s_mb%d' % (name, t),
          gate=Kind.F in self.ordered)

  def Build(self):
    """The forward pass: every 'F' in the lists' order; returns the last
    cell's outputs for the whole batch, whose gradient is `_Backward`."""
    p = self.p
    m = self.num_micro
    # Every op from here to the closing IdentityN is the pipeline's forward
    # pass (ids grow with creation): what loss.DependsOnForward looks for.
    self.first_id = internal_tf.OpId(tf.no_op(name='pipeline_begin'))
    with tf.device(self.devices[0]):
      self.flat_in = Flat(self.inputs)
      self.pieces = [None if x is None else tf.split(x, m, axis=p.batch_dim)
                     for x in self.flat_in]
      self.steps = self.layer.MicroBatchSteps(
          m, self.layer.StateDtype(self.inputs))
    self.x0 = [ToTuple(tf.nest.pack_sequence_as(
        self.inputs, [None if s is None else s[t] for s in self.pieces]))
               for t in range(m)]
    # Read each cell's weights onto its device once per step, not once per
    # micro-batch. Shards of a partitioned variable stay where they live
    # (lookups and per-shard matmuls run there; a copy would gather the whole
    # table onto the cell's device).
    def _Read(v):
      return v if sharding.IsShard(v) else tf.identity(CastHere(v))

    self.thetas = []
    for i, (name, _) in enumerate(self.cells):
      with tf.device(self.devices[i]), tf.name_scope('%s_theta' % name):
        self.thetas.append(self.theta[name].Transform(_Read))
    self.cell_in = [[None] * m for _ in self.cells]
    self.cell_out = [[None] * m for _ in self.cells]
    self.fwd_gates = {}
    spec = self._Spec(bool(self.recompute))
    for a in _WalkOrder(spec, self.forward_lists):
      if a.kind == Kind.F:
        self.F(a)
    with tf.device(self.devices[-1]):
      last = [Flat(o) for o in self.cell_out[-1]]
      merged = [None if parts[0] is None else
                tf.concat(parts, axis=p.batch_dim) for parts in zip(*last)]
      self.out_structure = self.cell_out[-1][0]
      present = [t for t in merged if t is not None]
      theta_leaves = [l for th in self.thetas for l in th.Flatten()]
      wrapped = WithBackward(
          [t for t in self.flat_in if t is not None] + theta_leaves, present,
          self._Backward)
    self.pipeline_op = wrapped[0].op if wrapped else None
    self.last_id = internal_tf.OpId(tf.no_op(name='pipeline_end'))
    if not self.cell_checks:
      with tf.device(self.devices[-1]), tf.name_scope('pipeline_checks'):
        wrapped = Checked(wrapped, '%s: an output' % p.name)
    it = iter(wrapped)
    merged = [None if t is None else next(it) for t in merged]
    out = tf.nest.pack_sequence_as(self.out_structure, merged)
    # A single output (tensor or NestedMap) is returned as itself.
    return out[0] if len(out) == 1 else out

  # --- The backward pass -------------------------------------------------------

  def _Backward(self, out_grads):
    """Gradients of (present inputs, theta leaves) from those of outputs:
    every backward action of the lists, walked in an order the data allows."""
    out_grads = loss.DropZeroGrads(out_grads, self.pipeline_op)
    depends = loss.DependsOnForward(out_grads, self.first_id, self.last_id)
    recompute = loss.Recompute(self.record, self.recompute, depends,
                               self.p.name)
    run = (self._WeightGradientRun()
           if (self.record.name, recompute) in
           records.SIZED_WEIGHT_GRADIENT_RUNS else 1)
    self.spec = self._Spec(recompute, run)
    self.schedule = loss.Lists(self.record, self.spec, depends, self.p.name)
    self.runs = {run[0]: run
                 for run in runs.WeightGradientRuns(self.schedule)}
    # What each enforced action waits for, and the actions awaited.
    self.waits = runs.Waits(self.schedule, self.ordered)
    self.awaited = {a for acts in self.waits.values() for a in acts}
    self.gates, self.completions = dict(self.fwd_gates), {}
    m = self.num_micro
    self.weights = [CellWeightGradients(th.Flatten(), m, self.ordered)
                    for th in self.thetas]
    self.scopes = {}  # (cell, micro-batch) -> its backward name scope.
    self.rebuilt = {}  # (cell, micro-batch) -> its recomputed (x, y).
    with tf.get_default_graph().colocate_with(None, ignore_existing=True):
      # dy[i][t]: the flat gradients of cell i's outputs of micro-batch t.
      self.dy = [[None] * m for _ in self.cells]
      self.dy[-1] = self._MicroBatchOutputGrads(out_grads)
      self.dx = [None] * m  # Cell 0's input gradients.
      walk = {Kind.F: self._FDone, Kind.R: self.R, Kind.I: self.I,
              Kind.B: self.B, Kind.W: self.W}
      for a in _WalkOrder(self.spec, self.schedule):
        walk[a.kind](a)
      self._Wire(self.gates, self.completions)
      sums = []
      for i, (name, _) in enumerate(self.cells):
        with tf.device(self.devices[i]):
          sums += self.weights[i].Totals('%s_theta/grad_sum' % name)
      in_grads = self._InputGrads(self.dx)
      if not self.cell_checks:
        with tf.device(self.devices[0]), tf.name_scope('pipeline_checks'):
          in_grads = Checked(in_grads, '%s: an input gradient' % self.p.name)
      return in_grads + sums

  def _Gate(self, kind, name):
    """A NoOp the action's ops wait for, where the record enforces its
    place; else None."""
    return tf.no_op(name=name) if kind in self.ordered else None

  def _Scope(self, i, t):
    """The name scope of cell i's backward actions on micro-batch t."""
    if (i, t) not in self.scopes:
      with tf.name_scope('%s_mb%d' % (self.cells[i][0], t)) as scope:
        self.scopes[(i, t)] = scope
    return tf.name_scope(self.scopes[(i, t)])

  def _Pending(self, i, t):
    """The positions of cell i's outputs of micro-batch t with a gradient."""
    return [k for k, (o, g) in enumerate(zip(Flat(self.cell_out[i][t]),
                                             self.dy[i][t]))
            if g is not None and IsFloat(o)]

  def _Complete(self, a, tensors, batched=()):
    """Adds the action's gradients to its cell's sums and, if an action
    waits for it, makes its completion (its whole run's, for a 'W')."""
    i = a.stage
    with tf.device(self.devices[i]):
      changed = self.weights[i].Add(a.kind, batched,
                                    '%s_theta/grad_sum' % self.cells[i][0])
      group = self.runs.get(a, [a])
      if any(w in self.awaited for w in group):
        done = Group(list(tensors) + changed) or self.gates[a] or tf.no_op()
        for w in group:
          self.completions[w] = done

  def _FDone(self, a):
    """A forward action ('F', built in Build): its completion, if awaited."""
    if a in self.awaited:
      with tf.device(self.devices[a.stage]):
        self.completions[a] = Group(Flat(self.cell_out[a.stage][a.micro_batch]))

  def R(self, a):
    """Cell i's forward pass of micro-batch t rebuilt behind its gate and
    the incoming gradient, so it runs in the backward pass (the same step
    and names under a fresh scope: the same random seeds; a recomputation
    is no further micro-batch: the accumulators keep their values)."""
    i, t = a.stage, a.micro_batch
    with tf.device(self.devices[i]), self._Scope(i, t):
      self.gates[a] = self._Gate(Kind.R, 'r_gate')
      idx = self._Pending(i, t)
      outs = []
      if idx:
        x = self.cell_in[i][t]
        deps = [self.dy[i][t][k] for k in idx] + (
            [self.gates[a]] if self.gates[a] is not None else [])
        with tf.control_dependencies(deps):
          x_r = [None if v is None else tf.identity(v, name='recompute_gate')
                 for v in Flat(x)]
        cell = self.cells[i][1]
        saved_accs = cell.GetAccumulatorValues()
        outs = Flat(self._CellFProp(i, tf.nest.pack_sequence_as(x, x_r),
                                    self.steps[t], 'recompute')[0])
        cell.SetAccumulatorValues(saved_accs)
        self.rebuilt[(i, t)] = (x_r, outs)
      if a in self.awaited:
        self.completions[a] = Group(outs) or self.gates[a] or tf.no_op()

  def I(self, a, whole=False):  # pylint: disable=invalid-name
    """Cell i's input gradients of micro-batch t (and those of weights used
    other than by a MatMul or a lookup of rows); its weight uses' operands
    go to the cell's `CellWeightGradients`. With `whole` ('B'), the
    micro-batch's weight gradients too."""
    i, t = a.stage, a.micro_batch
    owner = self.weights[i]
    with tf.device(self.devices[i]), self._Scope(i, t):
      gate = self.gates[a] = self._Gate(a.kind, 'bwd_gate')
      idx = self._Pending(i, t)
      flat_x = Flat(self.cell_in[i][t])
      outs = Flat(self.cell_out[i][t])
      if (i, t) in self.rebuilt:
        flat_x, outs = self.rebuilt[(i, t)]
      dx, tg, dys = None, [None] * len(owner.leaves), []
      if idx:
        grad_ys = [self.dy[i][t][k] for k in idx]
        if gate is not None:
          with tf.control_dependencies([gate]):
            grad_ys = [tf.identity(g) for g in grad_ys]
        dx, tg, dys = owner.Backward(t, [outs[k] for k in idx], flat_x,
                                     grad_ys)
      parts, own = [(tg, False)], (dx or []) + tg + dys
      if whole:
        with tf.name_scope('weight_grad'):
          batched = owner.Run([t])
        parts.append((batched, True))
        own += batched
    if dx is None:
      dx = [None] * len(Flat(self.cell_in[i][t]))
    if i:
      self.dy[i - 1][t] = dx
    else:
      self.dx[t] = dx
    self._Complete(a, own, parts)

  def B(self, a):
    """Cell i's whole backward pass of micro-batch t: 'I' and 'W' in one."""
    self.I(a, whole=True)

  def W(self, a):
    """A run of 'W's (`runs.WeightGradientRuns`), at its first: the weight
    gradients x^T dy of its micro-batches as one MatMul per weight."""
    if a not in self.runs:
      return  # Built with its run's first action.
    group = self.runs[a]
    i, name = a.stage, self.cells[a.stage][0]
    first, last = group[0].micro_batch, group[-1].micro_batch
    scope = ('%s_mb%d/weight_grad' % (name, first) if first == last else
             '%s_mb%d-%d/weight_grad' % (name, first, last))
    with tf.device(self.devices[i]), tf.name_scope(scope):
      w_gate = self._Gate(Kind.W, 'w_gate')
      with tf.control_dependencies([w_gate] if w_gate is not None else []):
        batched = self.weights[i].Run([w.micro_batch for w in group])
    for w in group:
      self.gates[w] = w_gate
    self._Complete(a, batched, [(batched, True)])

  def _Wire(self, gates, completions):
    """Each enforced action's gate waits for the actions before it on its
    device (`runs.Waits`)."""
    for a, awaited in self.waits.items():
      done = []
      for prev in awaited:
        if all(completions[prev] is not d for d in done):
          done.append(completions[prev])
          internal_tf.AddControlInput(gates[a], completions[prev])

  def _MicroBatchOutputGrads(self, out_grads):
    """Per micro-batch, the flat gradients of the last cell's outputs (None
    where the caller's loss does not depend on an output)."""
    with tf.device(self.devices[-1]), tf.name_scope('pipeline_backward'):
      return SplitGrads(Flat(self.out_structure), out_grads, self.num_micro,
                        self.p.batch_dim)

  def _InputGrads(self, dx):
    """The present inputs' gradients from those of each micro-batch."""
    with tf.device(self.devices[0]), tf.name_scope('pipeline_backward'):
      return ConcatGrads(self.flat_in, self.pieces, dx, self.p.batch_dim)


def ListSchedule(name):
  """The schedule function of record `name`: an `Interpreter` of its lists.

  The layer's `recompute` goes to the interpreter as it is: None is the
  record's default (`records.Schedule.recompute`); True adds each backward
  action's recomputation ('R') to the lists.
  """

  def Schedule(layer, theta, inputs, num_micro):
    return Interpreter(layer, theta, inputs, num_micro, name,
                       layer.params.recompute).Build()

  Schedule.__name__ = name
  Schedule.__doc__ = records.Get(name).help
  return Schedule
