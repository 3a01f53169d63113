"""The interpreter: builds a schedule's per-device action lists as a graph."""

from typing import Optional

import lingvo.compat as tf

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.core import cell_function
from lingvo_ext.core import matmul_grad
from lingvo_ext.core import sharding
from lingvo_ext.core.engine import records
from lingvo_ext.core.engine import runs
from lingvo_ext.core.engine import transforms
from lingvo_ext.core.engine.custom_gradient import WithBackward
from lingvo_ext.core.engine.kinds import Action
from lingvo_ext.core.engine.kinds import StageSpec
from lingvo_ext.core.engine.randomness import CellRandomness
from lingvo_ext.core.engine.simulate import CheckSchedule
from lingvo_ext.core.engine.tensors import CastHere
from lingvo_ext.core.engine.tensors import Flat as _Flat
from lingvo_ext.core.engine.tensors import Group as _Group
from lingvo_ext.core.engine.tensors import IsFloat as _IsFloat
from lingvo_ext.core.engine.tensors import ToTuple
from lingvo_ext.core.engine.weight_gradients import CellGradients


class Interpreter:
  """Runs a schedule's per-device action lists (generators.py) as a graph.

  Forward ('F'): for each micro-batch t and cell i, the cell runs on its
  device (scope '<cell>_mb<t>') with its own random seeds: one call of the
  cell's function (built once), or the cell's ops inline.

  Backward (inside the pipeline's custom gradient, one `tf.gradients` call
  per cell and micro-batch):

  - 'R': the cell's forward pass rebuilt from its stored input, with the
    same random seeds (re-materialisation); its 'I' or 'B' differentiates
    the rebuilt pass, so the forward pass keeps only cell inputs.
  - 'I': the gradients of the cell's inputs (and of weights used other than
    by a MatMul or a lookup of rows); its weight MatMuls' operands (x, dy)
    are kept for the 'W'.
  - 'W': the weight gradients x^T dy. A run of consecutive 'W' actions of
    one stage (`runs.WeightGradientRuns`) is one MatMul per weight over
    all its micro-batches' rows (`matmul_grad.WeightGradientBatcher`),
    instead of a weight-sized gradient per micro-batch summed at the end.
  - 'B': 'I' and 'W' of one micro-batch as one action.

  Every action has a gate (a NoOp its ops wait for) and a completion (an op
  that runs once its ops have, its running weight-gradient sums included):
  each action's gate waits for the completion of the action before it on its
  device, so each device runs its list in order, while TensorFlow's executor
  runs the devices side by side. The lists are checked for completeness and
  deadlock under the same dependencies before any graph is built
  (`CheckSchedule`). They are made when tf.gradients builds the
  backward pass: whether the caller's loss lets a backward action start
  before the last forward one (`_DyDependsOnForward`) decides `recompute`
  where it is None and, for a loss that does not, puts each device's forward
  actions first (`transforms.ForwardsFirst`).
  """

  def __init__(self, layer, theta, inputs, num_micro: int,
               schedule_name: str, recompute: Optional[bool]):
    self.layer = layer
    self.p = layer.params
    self.cells = layer.Cells()
    self.devices = layer.Devices()
    self.num_micro = num_micro
    self.schedule_name = schedule_name
    # None: recompute only for a loss not linear in the outputs.
    self.recompute = recompute
    self.inputs = inputs
    self.theta = theta
    # Every forward (cell, micro-batch) behind a 'fwd_gate' NoOp where the
    # schedule enforces its place: the action before it on its device holds
    # it back.
    self.gated = 'F' in records.ORDERED_KINDS[schedule_name]
    self.num_devices = len(set(self.devices))
    # Checked now, so a bad (K, M) fails at FProp, not in tf.gradients.
    records.Build(schedule_name, self._Spec(bool(recompute)))
    # Per cell, its function (None: built inline), found or made when the
    # first micro-batch's inputs are known (cell_function.ForCell).
    self.cell_fns = [None] * len(self.cells)
    self.fn_jit = [None] * len(self.cells)  # None: no function wanted.
    jit = getattr(self.p, 'jit_compile', False)
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
    return records.Placed(self.schedule_name, StageSpec(
        len(self.cells), self.num_devices, self.num_micro, recompute, run))

  def _WeightGradientRun(self) -> int:
    """How many micro-batches a run of 'W's takes ('unrolled' with
    recompute, '1f1b' without): `runs.WeightGradientRunLength` over the
    MatMuls the cell functions export (1 where none does: cells built
    inline).
    """
    weights, operands = {}, 0
    for i in range(len(self.cells)):
      outs = [o for o in _Flat(self.cell_out[i][0]) if o is not None]
      for use in (cell_function.ExportedOperands(outs[0].op) if outs else []):
        if use.rows:  # A lookup: its gradient is sparse, not weight-sized.
          continue
        sizes = [use.weight.shape.num_elements(),
                 use.operand.shape.num_elements(),
                 use.zero.shape.num_elements()]
        if None in sizes:
          return 1
        weights[use.weight.ref()] = sizes[0]
        operands += sizes[1] + sizes[2]
    return runs.WeightGradientRunLength(sum(weights.values()), operands,
                                           self.num_micro)

  def _CellFProp(self, i, x, step, scope, gate=False):
    """Cell i on micro-batch input x, in a fresh name scope `scope`.

    With `gate`, every op of the cell waits for a NoOp 'fwd_gate' (returned
    second), which the action before it on its device holds back.
    """
    _, cell = self.cells[i]
    if self.cell_fns[i] is not None:
      # One traced function per cell; this is one call of it.
      with tf.name_scope(scope):
        if not gate:
          return ToTuple(self.cell_fns[i](self.thetas[i], ToTuple(x), step)), None
        gate_op = tf.no_op(name='fwd_gate')
        with tf.control_dependencies([gate_op]):
          return ToTuple(self.cell_fns[i](self.thetas[i], ToTuple(x), step)), gate_op
    with matmul_grad.PipelineMatMulGradients(self.devices[i]):
      with CellRandomness(step, scope):
        if not gate:
          return ToTuple(cell.FProp(self.thetas[i], *ToTuple(x))), None
        gate_op = tf.no_op(name='fwd_gate')
        with tf.control_dependencies([gate_op]):
          return ToTuple(cell.FProp(self.thetas[i], *ToTuple(x))), gate_op

  def Build(self):
    p = self.p
    num_cells = len(self.cells)
    m = self.num_micro
    # Every op from here to the closing IdentityN is the pipeline's forward
    # pass (ids grow with creation): what `_DyDependsOnForward` looks for.
    self.first_id = internal_tf.OpId(tf.no_op(name='pipeline_begin'))
    with tf.device(self.devices[0]):
      flat_in = _Flat(self.inputs)
      pieces = [
          None if x is None else tf.split(x, m, axis=p.batch_dim)
          for x in flat_in
      ]
      steps = self.layer.MicroBatchSteps(
          m, self.layer.StateDtype(self.inputs))
    self.pieces = pieces
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
    self.cell_in = [[None] * m for _ in range(num_cells)]
    self.cell_out = [[None] * m for _ in range(num_cells)]
    self.gates = [[None] * m for _ in range(num_cells)]
    self.steps = steps
    for t in range(m):
      x = tf.nest.pack_sequence_as(
          self.inputs, [None if s is None else s[t] for s in pieces])
      x = ToTuple(x)
      for i, (name, cell) in enumerate(self.cells):
        with tf.device(self.devices[i]):
          if t == 0 and self.fn_jit[i] is not None:
            self.cell_fns[i] = cell_function.ForCell(
                cell, '%s_fprop' % name, self.fn_jit[i], self.thetas[i], x,
                steps[t])
          fn = self.cell_fns[i]
          if t == 0 and fn is not None and fn.HasUnexportedLookups(
              self.thetas[i], x, steps[t]):
            # A lookup the function does not export (another axis,
            # batch_dims): its gradient stays sparse inline.
            tf.logging.info('%s: cell %s gathers from a weight other than '
                            'by rows; built inline.', p.name, name)
            self.cell_fns[i] = None
          if self.cell_fns[i] is not None:
            # A function call's inputs are Identities: tf.gradients stops
            # there, not at the previous cell's call op (for which it would
            # build a dead SymbolicGradient).
            x = tf.nest.pack_sequence_as(
                x, [None if v is None else tf.identity(v) for v in _Flat(x)])
          self.cell_in[i][t] = x
          x, self.gates[i][t] = self._CellFProp(
              i, x, steps[t], '%s_mb%d' % (name, t), gate=self.gated)
          self.cell_out[i][t] = x
    with tf.device(self.devices[-1]):
      last = [_Flat(o) for o in self.cell_out[-1]]
      merged = [
          None if parts[0] is None else tf.concat(parts, axis=p.batch_dim)
          for parts in zip(*last)
      ]
      self.out_structure = self.cell_out[-1][0]
      present = [t for t in merged if t is not None]
      theta_leaves = [l for th in self.thetas for l in th.Flatten()]
      self.flat_in = flat_in
      wrapped = WithBackward(
          [t for t in flat_in if t is not None] + theta_leaves, present,
          self._Backward)
    self.pipeline_op = wrapped[0].op if wrapped else None
    self.last_id = internal_tf.OpId(tf.no_op(name='pipeline_end'))
    it = iter(wrapped)
    merged = [None if t is None else next(it) for t in merged]
    out = tf.nest.pack_sequence_as(self.out_structure, merged)
    # A single output (tensor or NestedMap) is returned as itself.
    return out[0] if len(out) == 1 else out

  def _DyDependsOnForward(self, out_grads) -> bool:
    """Whether the caller's output gradients need this pipeline's forward.

    They do not when the loss is linear in the outputs with static shapes
    (e.g. per-example losses from the last cell, summed): then a
    micro-batch's backward pass may start before later forward passes end.
    """
    stack = []
    for g in out_grads:
      if isinstance(g, tf.IndexedSlices):
        stack += [t.op for t in (g.values, g.indices, g.dense_shape)
                  if t is not None]
      elif g is not None:
        stack.append(g.op)
    seen = set(stack)
    while stack:
      op = stack.pop()
      if self.first_id <= internal_tf.OpId(op) <= self.last_id:
        return True
      for parent in [t.op for t in op.inputs] + list(op.control_inputs):
        if parent not in seen:
          seen.add(parent)
          stack.append(parent)
    return False

  def _DropZeroGrads(self, out_grads):
    # tf.gradients gives an output it has no gradient for zeros_like(output)
    # when another output has one: no gradient, and no wait for the output.
    return [
        None if isinstance(g, tf.Tensor) and g.op.type == 'ZerosLike' and
        g.op.inputs[0].op is self.pipeline_op else g
        for g in out_grads
    ]

  def _MicroBatchOutputGrads(self, out_grads):
    """Per micro-batch, the flat gradients of the last cell's outputs.

    None where the caller's loss does not depend on an output.
    """
    p = self.p
    m = self.num_micro
    with tf.device(self.devices[-1]), tf.name_scope('pipeline_backward'):
      it = iter(out_grads)
      dys_flat = []
      for o in _Flat(self.out_structure):
        g = None if o is None else next(it)
        dys_flat.append(None if g is None else
                        tf.split(g, m, axis=p.batch_dim))
    return [[None if d is None else d[t] for d in dys_flat] for t in range(m)]

  def _InputGrads(self, dy):
    """The present inputs' gradients from those of each micro-batch."""
    p = self.p
    in_grads = []
    with tf.device(self.devices[0]), tf.name_scope('pipeline_backward'):
      for k, x in enumerate(self.flat_in):
        if x is None:
          continue
        parts = [dy[t][k] for t in range(self.num_micro)]
        if all(g is None for g in parts):
          in_grads.append(None)
          continue
        parts = [tf.zeros_like(self.pieces[k][t]) if g is None else g
                 for t, g in enumerate(parts)]
        in_grads.append(tf.concat(parts, axis=p.batch_dim))
    return in_grads

  def _Schedule(self, out_grads):
    """(the StageSpec, recompute decided; the action lists) for these
    output gradients."""
    p = self.p
    depends = self._DyDependsOnForward(out_grads)
    recompute = self.recompute
    record = records.BY_NAME[self.schedule_name]
    if recompute is None:
      # The record's default: '1f1b' recomputes only when the forward passes
      # of all micro-batches must end before any backward pass starts.
      recompute = depends if record.recompute == records.WHEN_NEEDED else (
          record.recompute == records.ALWAYS)
    elif (recompute is False and depends and
          record.nonlinear_loss == records.NEEDS_RECOMPUTE):
      raise ValueError(
          "%s: schedule=%r with recompute=False needs output gradients "
          "that do not depend on the pipeline's outputs (a loss linear in "
          'them, e.g. per-example losses from the last cell, summed); this '
          'loss is not: set recompute=None (recompute when needed) or True.'
          % (p.name, self.schedule_name))
    run = (self._WeightGradientRun()
           if (self.schedule_name, bool(recompute)) in
           records.SIZED_WEIGHT_GRADIENT_RUNS else 1)
    spec = self._Spec(recompute, run)
    schedule = records.Build(self.schedule_name, spec)
    forwards_first = transforms.ForwardsFirst(schedule)
    if depends and forwards_first != schedule:
      # No output gradient before every forward pass has run: each device
      # runs its forward actions first, then the schedule's backward order.
      tf.logging.info(
          '%s: the loss is not linear in the pipeline\'s outputs; schedule '
          '%r runs every forward pass before its backward actions.', p.name,
          self.schedule_name)
      schedule = forwards_first
      CheckSchedule(spec, schedule)
    return spec, schedule

  def _Backward(self, out_grads):
    """Gradients of (present inputs, theta leaves) from those of outputs."""
    m = self.num_micro
    num_cells = len(self.cells)
    out_grads = self._DropZeroGrads(out_grads)
    self.spec, self.schedule = self._Schedule(out_grads)
    # Each run of 'W's by its first action.
    self.runs = {run[0]: run
                 for run in runs.WeightGradientRuns(self.schedule)}
    gates, completions = {}, {}
    # What each enforced action waits for, and the actions awaited.
    self.waits = runs.Waits(self.schedule,
                               records.ORDERED_KINDS[self.schedule_name])
    self.awaited = {a for acts in self.waits.values() for a in acts}
    for i in range(num_cells):
      for t in range(m):
        gates[Action('F', i, t)] = self.gates[i][t]
    with tf.get_default_graph().colocate_with(None, ignore_existing=True):
      dy = self._MicroBatchOutputGrads(out_grads)
      sums = [None] * num_cells
      for i in reversed(range(num_cells)):
        dy, sums[i] = self._CellBackward(i, dy, gates, completions)
      for i in range(num_cells):
        for t in range(m):
          f = Action('F', i, t)
          if f in self.awaited:
            with tf.device(self.devices[i]):
              completions[f] = _Group(_Flat(self.cell_out[i][t]))
      self._Wire(gates, completions)
      return (self._InputGrads(dy) +
              [g for cell_sums in sums for g in cell_sums])

  def _Recompute(self, i, t, gates):
    """Cell i's forward pass of micro-batch t rebuilt behind `gates` ('R').

    `gates` include the incoming gradient, so the rebuilt pass runs in the
    backward pass, not beside the forward one.

    The same step and the same names under a fresh scope: the same random
    seeds as the forward pass (see CellRandomness). A recomputation is no
    further micro-batch: the cell's accumulators keep what its forward
    passes made of them.

    Returns:
      (the rebuilt pass's flat inputs, its flat outputs).
    """
    x = self.cell_in[i][t]
    with tf.control_dependencies(gates):
      x_r = [None if v is None else tf.identity(v, name='recompute_gate')
             for v in _Flat(x)]
    cell = self.cells[i][1]
    saved_accs = cell.GetAccumulatorValues()
    y_r = _Flat(self._CellFProp(i, tf.nest.pack_sequence_as(x, x_r),
                                self.steps[t], 'recompute')[0])
    cell.SetAccumulatorValues(saved_accs)
    return x_r, y_r

  def _CellBackward(self, i, dy, gates, completions):
    """Cell i's backward actions; returns (its input grads, theta grads).

    Args:
      i: The cell.
      dy: Per micro-batch, the flat list of gradients of the cell's outputs
        (None entries where there is none).
      gates: Action -> its gate, filled in for cell i's actions.
      completions: Action -> its completion, likewise.

    Returns:
      (per micro-batch, the flat gradients of the cell's inputs; the
      gradients of the cell's theta leaves).
    """
    m = self.num_micro
    name = self.cells[i][0]
    leaves = self.thetas[i].Flatten()
    recompute = self.spec.recompute
    device_actions = self.schedule[self.spec.Device(i)]
    split = Action('I', i, 0) in device_actions
    ordered = records.ORDERED_KINDS[self.schedule_name]

    def Gate(kind, gate_name):
      """A NoOp the action's ops wait for, where its place is enforced."""
      return tf.no_op(name=gate_name) if kind in ordered else None

    dx = [None] * m
    batchers = [matmul_grad.WeightGradientBatcher(leaves) for _ in range(m)]
    # Per backward action: the tensors its completion includes, and the
    # weight gradients it adds to the running sums.
    own, parts = {}, {}
    for t in range(m):
      b = Action('I' if split else 'B', i, t)
      with tf.device(self.devices[i]), tf.name_scope('%s_mb%d' % (name, t)):
        outs = _Flat(self.cell_out[i][t])
        idx = [k for k, (o, g) in enumerate(zip(outs, dy[t]))
               if g is not None and _IsFloat(o)]
        flat_x = _Flat(self.cell_in[i][t])
        if recompute:
          r = Action('R', i, t)
          gates[r] = Gate('R', 'r_gate')
          if idx:
            flat_x, outs = self._Recompute(
                i, t, [dy[t][k] for k in idx] +
                ([gates[r]] if gates[r] is not None else []))
          if r in self.awaited:
            completions[r] = (_Group(outs if idx else []) or gates[r] or
                              tf.no_op())
        gate = Gate(b.kind, 'bwd_gate')
        gates[b] = gate
        tg, dys = [None] * len(leaves), []
        if idx:
          grad_ys = [dy[t][k] for k in idx]
          if gate is not None:
            with tf.control_dependencies([gate]):
              grad_ys = [tf.identity(g) for g in grad_ys]
          with batchers[t]:
            dx[t], tg, dys = CellGradients([outs[k] for k in idx], flat_x,
                                            leaves, grad_ys, batchers[t])
        own[b] = (dx[t] or []) + tg + dys
        parts[b] = [(tg, False)]
        if not split:
          with tf.name_scope('weight_grad'):
            batched = batchers[t].Gradients(leaves)
          own[b] += batched
          parts[b].append((batched, True))
    if split:
      for run in self.runs.values():
        if run[0].stage != i:
          continue
        first, last = run[0].micro_batch, run[-1].micro_batch
        scope = ('%s_mb%d/weight_grad' % (name, first) if first == last else
                 '%s_mb%d-%d/weight_grad' % (name, first, last))
        with tf.device(self.devices[i]), tf.name_scope(scope):
          w_gate = Gate('W', 'w_gate')
          with tf.control_dependencies([w_gate] if w_gate is not None else []):
            batched = matmul_grad.WeightGradientBatcher.Merged(
                leaves, [batchers[a.micro_batch] for a in run]).Gradients(
                    leaves)
        for a in run:
          gates[a] = w_gate
        own[run[0]] = list(batched)
        parts[run[0]] = [(batched, True)]
    # Running sums: each weight-gradient MatMul's result (a run's or a
    # 'B''s), and every part of an enforced action, is added as its action
    # completes, in the device's order (so no sum waits for an action that
    # comes later there), and the completion includes the sum: the next
    # action on the device waits for it, and each weight-sized part is freed
    # once added. (Grappler also leaves an add that drives a control edge as
    # it is; a chain of plain adds it folds into one AddN of all parts, every
    # part alive until the last: FC 8 x 512, 2 cells, M = 32: 1149 MB against
    # 878 MB.) The other parts (an unenforced action's gradients of weights
    # used other than by MatMuls: biases, scales) go into one AddN at the
    # end, one op rather than one per micro-batch.
    acc = [None] * len(leaves)
    rest = [[] for _ in leaves]
    for a in device_actions:
      if a not in own:
        continue
      changed = []
      for grads, batched in parts[a]:
        for k, g in enumerate(grads):
          if g is None:
            continue
          if not batched and a.kind not in ordered:
            rest[k].append(g)
            continue
          with tf.device(self.devices[i]), tf.name_scope(
              '%s_theta/grad_sum' % name):
            acc[k] = matmul_grad.SumGradients([acc[k], g])
          changed.append(acc[k])
      run = self.runs.get(a, [a])
      if any(w in self.awaited for w in run):
        done = _Group(own[a] + changed) or gates[a] or tf.no_op()
        for w in run:
          completions[w] = done
    with tf.device(self.devices[i]), tf.name_scope('%s_theta/grad_sum' % name):
      acc = [matmul_grad.SumGradients([a] + r) if r else a
             for a, r in zip(acc, rest)]
    dx = [[None] * len(_Flat(self.cell_in[i][t])) if dx[t] is None else dx[t]
          for t in range(m)]
    return dx, acc

  def _Wire(self, gates, completions):
    """Each enforced action's gate (`records.ORDERED_KINDS`) waits for the
    actions before it on its device (`runs.Waits`)."""
    for a, awaited in self.waits.items():
      done = []
      for prev in awaited:
        if all(completions[prev] is not d for d in done):
          done.append(completions[prev])
          internal_tf.AddControlInput(gates[a], completions[prev])


def ListSchedule(name):
  """The schedule function that runs `records.ACTION_SCHEDULES[name]`.

  The layer's `recompute` goes to the engine as it is: None lets '1f1b'
  recompute only for a loss not linear in the outputs, and the other
  schedules not at all; True adds each backward action's recomputation
  ('R') to the lists.
  """

  def Schedule(layer, theta, inputs, num_micro):
    return Interpreter(layer, theta, inputs, num_micro, name,
                   layer.params.recompute).Build()

  Schedule.__name__ = name
  Schedule.__doc__ = records.ACTION_SCHEDULES[name].__doc__
  return Schedule
