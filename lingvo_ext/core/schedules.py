"""Pipeline schedules: how micro-batches flow through a PipeliningLayer's cells.

A schedule is a function with one signature,

  Schedule(layer, theta, inputs, num_micro_batches) -> outputs

where `layer` is the `gpipe.PipeliningLayer` (its cells, devices and params),
`theta` its weights, `inputs` the tuple of FProp inputs after the layer's
`before_tpl` layers and `outputs` the last cell's outputs for the whole batch.
`PipeliningLayer` picks one from `SCHEDULES` by its `schedule` param; a new
schedule is one new entry there.

- 'unrolled': every (micro-batch, cell) pair is its own subgraph on the cell's
  device, so TensorFlow's executor overlaps cells as data arrives. The
  backward pass is built here (see `_Engine`), which lets it batch weight
  gradients across micro-batches and, with `recompute=True`, re-materialise
  each cell's forward pass in its backward pass.
- '1f1b': the same subgraphs, and control dependencies hold cell i to at most
  K - i micro-batches in flight, so activation memory is bounded by K, not M.
  When the caller's output gradients do not need the forward pass (a loss
  linear in the outputs, e.g. per-example losses from the last cell, summed),
  cell i's forward pass of micro-batch t waits for its backward pass of
  t - (K - i) and nothing is recomputed (weight gradients: one MatMul per
  group of K micro-batches, whose operands stay alive until it runs).
  Otherwise no backward pass can start before every forward pass ends: the
  forward pass keeps only cell-boundary activations and each cell alternates
  one recomputed forward and one backward micro-batch in the backward pass.
  Checked when tf.gradients builds the backward pass (`recompute=None`).
- 'recurrent': Lingvo's `StackedRecurrent` loop, which always recomputes.
- 'interleaved_1f1b', 'zero_bubble': each device runs its action list from
  `actions.py` in order (`_ListEngine`); for a loss not linear in the
  outputs, its forward actions first (`actions.ForwardsFirst`).
"""

import contextlib
from typing import Callable, List, Optional

import lingvo.compat as tf
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils
from lingvo.core import recurrent

from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.core import actions
from lingvo_ext.core import cell_function
from lingvo_ext.core import graph_state
from lingvo_ext.core import matmul_grad
from lingvo_ext.core import sharding

_MICRO_BATCH_STATE_NAME = 'micro_batch_state'
# Gradient of the IdentityN that closes each engine-built pipeline; the
# backward function of every such op is looked up by the op's name.
_PIPELINE_GRAD_NAME = 'LingvoExtPipelineBackward'
# Graph state (graph_state, freed with the graph): op name -> fn.
_BACKWARD_FNS = 'pipeline_backward_fns'


def ToTuple(x):
  if isinstance(x, list):
    return tuple(x)
  return x if isinstance(x, tuple) else (x,)


# --- Per-micro-batch random seeds ---------------------------------------------


def _CellStepSeedPair(p, unused_global_step=None, op_seed=None, *, prefix):
  """Lingvo's in-cell seed pair, for a cell built under name scope `prefix`.

  Inside StackedRecurrent a cell is traced in its own function graph, so the
  seed it takes from its 'op_seed' name scope has no outer scope in it. Built
  inline, the cell's ops sit under `prefix`; stripping it gives the name, and
  so the seed, that the same op gets in Lingvo's loop.

  Args:
    p: The calling layer's params (random_seed, is_inference).
    unused_global_step: Lingvo's signature; the step comes from
      GetOverWriteGlobalStep (the micro-batch's step).
    op_seed: An extra op-level seed, as in py_utils.GenerateStepSeedPair.
    prefix: The name scope the cell is built in, ending with '/'.

  Returns:
    A [2] seed tensor for stateless random ops.
  """
  seed_dtype = tf.int32 if py_utils.use_tpu() else tf.int64
  if p.is_inference and p.random_seed is None:
    # As Lingvo: an exported inference graph without a seed stays random.
    return tf.random.uniform([2], maxval=seed_dtype.max, dtype=seed_dtype)
  with tf.name_scope('op_seed') as scope:
    if scope.startswith(prefix):
      scope = scope[len(prefix):]
    step = tf.cast(lingvo_gpipe.GetOverWriteGlobalStep(), seed_dtype)
    name_seed = tf.cast(py_utils.GenerateSeedFromName(scope), seed_dtype)
    seeds = tf.stack([step, name_seed])
    if p.random_seed is not None:
      seeds += p.random_seed
    if op_seed is not None:
      seeds += tf.cast(op_seed, seed_dtype)
    return seeds


@contextlib.contextmanager
def CellRandomness(micro_batch_step, scope):
  """Random ops of a cell built inside seed as in Lingvo's pipeline loop.

  Lingvo's PipeliningLayer runs each cell under CellFnFPropOpReplacementWrapper
  with the global step overwritten by the micro-batch's step
  (global_step * num_micro_batches + t): stateless random ops (e.g.
  DeterministicDropoutLayer) seed from it and from their name scope within
  the cell. Schedules that build cells inline, not in StackedRecurrent, wrap
  each (cell, micro-batch) FProp in this to get the same random streams.

  Args:
    micro_batch_step: The micro-batch's step tensor, in the state dtype as
      Lingvo passes it.
    scope: Name of a fresh name scope to build the cell in.

  Yields:
    The name scope string (ending with '/').
  """
  graph = tf.get_default_graph()
  collection = graph.get_collection_ref(
      internal_lingvo.OVERWRITE_GLOBAL_STEP_COLLECTION)
  saved_collection = list(collection)
  with tf.name_scope(scope) as prefix:
    try:
      lingvo_gpipe.SetOverWriteGlobalStep(micro_batch_step, graph)
      with internal_lingvo.StepSeedPairFn(
          lambda *a, **kw: _CellStepSeedPair(*a, prefix=prefix, **kw)):
        yield prefix
    finally:
      collection[:] = saved_collection


# --- A custom gradient for a whole pipeline -----------------------------------


@tf.RegisterGradient(_PIPELINE_GRAD_NAME)
def _PipelineBackward(op, *grads):
  fn = graph_state.Peek(op.graph, _BACKWARD_FNS)[op.name]
  return fn(list(grads))


def _WithBackward(inputs: List, outputs: List, backward_fn: Callable) -> List:
  """Returns `outputs`, whose gradient is `backward_fn` instead of autodiff.

  Args:
    inputs: Tensors the outputs depend on (the pipeline's inputs, weights).
    outputs: Tensors computed from them.
    backward_fn: Takes the gradients of `outputs` (None where the caller's
      loss does not depend on one) and returns those of `inputs`.

  Returns:
    Identities of `outputs`. Autodiff does not look inside: the forward
    pass's internal tensors are kept only if `backward_fn` uses them.
  """
  graph = tf.get_default_graph()
  with graph.gradient_override_map({'IdentityN': _PIPELINE_GRAD_NAME}):
    ids = tf.identity_n(list(inputs) + list(outputs))
  n = len(inputs)

  def _Backward(grads):
    in_grads = backward_fn(grads[n:])
    return list(in_grads) + [None] * len(outputs)

  graph_state.Get(graph, _BACKWARD_FNS, dict)[ids[0].op.name] = _Backward
  return ids[n:]


# --- The engine behind 'unrolled' and '1f1b' ----------------------------------


def CastHere(v):
  """`v`, cast under the current device if it is a cast weight.

  Lingvo's fprop_dtype (mixed precision) casts each float32 weight to
  bfloat16 where theta is taken, on whatever device that is; cast again
  here, on the cell's device, the float32 weight does not cross devices
  (processes) to be cast, and its gradient comes back float32 on the cell's
  device. The first cast is then unused and pruned.
  """
  if (v is not None and not isinstance(v, tf.Variable) and
      getattr(v, 'op', None) is not None and v.op.type == 'Cast' and
      v.op.inputs[0].dtype != v.dtype):
    return tf.cast(v.op.inputs[0], v.dtype)
  return v


def _Flat(structure) -> List:
  return tf.nest.flatten(structure)


def _IsFloat(t) -> bool:
  return t is not None and t.dtype.is_floating


def _Group(tensors):
  tensors = [t for t in tensors if t is not None]
  return tf.group(*tensors) if tensors else None


def _CellGradients(ys, flat_x, leaves, grad_ys):
  """One cell's backward pass on one micro-batch.

  Args:
    ys: The cell's outputs that have gradients.
    flat_x: The cell's flat inputs (None entries allowed).
    leaves: The cell's theta leaves.
    grad_ys: The gradients of `ys`.

  Called inside a `matmul_grad.WeightGradientBatcher` of `leaves`: the
  weight gradients of a cell function's exported uses go to it.

  Returns:
    (gradients of flat_x, aligned with it; gradients of leaves; the output
    gradients of the cell function's exported weight MatMuls, which the
    batcher holds for the weight gradients: this backward pass's ops have run
    once they have).
  """
  # A tensor that is several of the cell's inputs (e.g. a FetchLayer
  # activation that is also the main output of the cell before) gets its
  # whole gradient once: tf.gradients would return it for every occurrence,
  # and the cell before would sum them.
  seen, diff_x = set(), []
  for v in flat_x:
    if not _IsFloat(v) or v.ref() in seen:
      diff_x.append(None)
    else:
      seen.add(v.ref())
      diff_x.append(v)
  xs = [v for v in diff_x if v is not None]
  # A cell function's weight MatMuls and lookups leave their weight gradients
  # out and export (weight, operand, zero): the zero's gradient is the dy.
  operands = []
  for op in {y.op.name: y.op for y in ys}.values():
    operands += cell_function.ExportedOperands(op)
  zeros = [e.zero for e in operands]
  # stop_gradients: an input that also reaches an output through an earlier
  # cell (a passed-through activation) must not count that path here; the
  # earlier cell's backward pass does.
  grads = tf.gradients(ys, xs + leaves + zeros, grad_ys=grad_ys,
                       stop_gradients=xs + leaves)
  it = iter(grads[:len(xs)])
  leaf_grads = grads[len(xs):len(xs) + len(leaves)]
  # Every caller builds this inside a batcher of `leaves`, whose weights the
  # exported operands' are (the call's theta arguments).
  batcher = matmul_grad.CurrentBatcher()
  exported_dys = grads[len(xs) + len(leaves):]
  for e, dy in zip(operands, exported_dys):
    if dy is not None:
      batcher.AddOperands(e.weight, e.operand, dy, e.rows)
  return ([None if v is None else next(it) for v in diff_x], leaf_grads,
          [dy for dy in exported_dys if dy is not None])


class _Engine:
  """Builds a pipeline's forward pass and its hand-built backward pass.

  Forward: for each micro-batch t and cell i, the cell runs on its device
  (scope '<cell>_mb<t>') with its own random seeds; under a window, behind a
  NoOp 'fwd_gate'. Only the cells' inputs are kept for the backward pass when
  recomputing; otherwise the backward pass differentiates the forward
  subgraphs themselves.

  Backward (one `tf.gradients` call per cell and micro-batch, inside the
  pipeline's custom gradient):

  - `recompute`: the cell's forward pass is rebuilt from its stored input,
    gated by a control dependency on the incoming gradient (so it runs in the
    backward pass, not beside the forward), with the same random seeds.
  - `window`: with a window W_i, cell i's recompute of micro-batch t also
    waits for its backward pass of micro-batch t - W_i and for the weight
    gradient of that micro-batch's group (groups of W_i micro-batches): the
    1F1B order, with at most W_i micro-batches' activations alive in cell i.
    Without recomputation its forward pass waits instead (`_HoldForward`),
    with weight gradients in groups of K.
  - `recompute` None (under a window): decided per tf.gradients call by
    `_DyDependsOnForward`.
  - Weight gradients: each MatMul's x^T dy is collected across a group of
    micro-batches (all M, or W_i under a window) and computed as one MatMul of
    the concatenated rows, instead of one materialised weight gradient per
    micro-batch summed at the end (`matmul_grad.WeightGradientBatcher`).
  """

  def __init__(self, layer, theta, inputs, num_micro: int, recompute: bool,
               window: Optional[Callable[[int], int]] = None):
    self.layer = layer
    self.p = layer.params
    self.cells = layer.Cells()
    self.devices = layer.Devices()
    self.num_micro = num_micro
    self.recompute = recompute
    self.window = window
    self.inputs = inputs
    self.theta = theta
    # Every forward (cell, micro-batch) behind a 'fwd_gate' NoOp that the
    # backward pass may hold back.
    self.gated = bool(window)
    # Per cell, its function (None: built inline).
    self.cell_fns = [None] * len(self.cells)
    jit = getattr(self.p, 'jit_compile', False)
    if getattr(self.p, 'cell_functions', False) or jit:
      for i, (name, cell) in enumerate(self.cells):
        if any(sharding.IsShard(v) for v in theta[name].Flatten()):
          # A partitioned variable's shards are read where they live (see
          # Build); a function would read each one onto the cell's device.
          tf.logging.info('%s: cell %s holds variable shards; built inline.',
                          self.p.name, name)
          continue
        self.cell_fns[i] = cell_function.CellFunction(
            cell, '%s_fprop' % name, jit)

  def _CellFProp(self, i, x, step, scope, gate=False):
    """Cell i on micro-batch input x, in a fresh name scope `scope`.

    With `gate`, every op of the cell waits for a NoOp 'fwd_gate' (returned
    second), which the backward pass may hold back (see `_HoldForward`).
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
      for i, (name, _) in enumerate(self.cells):
        with tf.device(self.devices[i]):
          fn = self.cell_fns[i]
          if fn is not None and not fn.traced and fn.HasUnexportedLookups(
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
      wrapped = _WithBackward(
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

  def _Backward(self, out_grads):
    """Gradients of (present inputs, theta leaves) from those of outputs."""
    p = self.p
    num_cells = len(self.cells)
    out_grads = self._DropZeroGrads(out_grads)
    recompute = self.recompute
    if recompute is None:
      # '1f1b' by default: recompute only when the forward passes of all
      # micro-batches must end before any backward pass starts.
      recompute = self._DyDependsOnForward(out_grads)
    elif recompute is False and self.window and self._DyDependsOnForward(
        out_grads):
      raise ValueError(
          "%s: schedule='1f1b' with recompute=False needs output gradients "
          "that do not depend on the pipeline's outputs (a loss linear in "
          'them, e.g. per-example losses from the last cell, summed); this '
          'loss is not: set recompute=None (recompute when needed) or True.'
          % p.name)
    with tf.get_default_graph().colocate_with(None, ignore_existing=True):
      dy = self._MicroBatchOutputGrads(out_grads)
      theta_grads = [[] for _ in range(num_cells)]
      for i in reversed(range(num_cells)):
        dy = self._CellBackward(i, dy, theta_grads[i], recompute)
      out = self._InputGrads(dy)
      for i in range(num_cells):
        with tf.device(self.devices[i]), tf.name_scope(
            '%s_theta/grad_sum' % self.cells[i][0]):
          leaves = self.thetas[i].Flatten()
          for k, leaf in enumerate(leaves):
            parts = [g[k] for g in theta_grads[i] if g[k] is not None]
            if not parts:
              out.append(None)
            elif len(parts) == 1:
              out.append(parts[0])
            elif self.window and not any(
                isinstance(g, tf.IndexedSlices) for g in parts):
              # A running sum, in backward order: each part is freed once
              # added, so weight-sized parts do not pile up with M.
              acc = parts[0]
              for part in parts[1:]:
                acc = acc + part
              out.append(acc)
            else:
              # Sparse parts (lookups) stay sparse when all are.
              out.append(matmul_grad.SumGradients(parts))
      return out

  def _CellBackward(self, i, dy, theta_grads, recompute):
    """Backward pass of cell i for every micro-batch; returns its input grads.

    Args:
      i: The cell.
      dy: Per micro-batch, the flat list of gradients of the cell's outputs
        (None entries where there is none).
      theta_grads: Appended with one flat list of theta-leaf gradients per
        group of micro-batches.
      recompute: Whether to rebuild the cell's forward pass here; if not, the
        forward subgraphs are differentiated (and, under a window, held back
        by `_HoldForward`).

    Returns:
      Per micro-batch, the gradients of the cell's inputs, in the structure
      of its inputs (None for the whole micro-batch if none has any).
    """
    m = self.num_micro
    name = self.cells[i][0]
    leaves = self.thetas[i].Flatten()
    dx = [None] * m  # Flat, per micro-batch.
    done = [None] * m
    window = self.window(i) if self.window else None
    # Weight gradients: one MatMul per group of micro-batches. Recomputing,
    # groups of W_i (the recompute of t waits for the group of t - W_i);
    # else groups of K, held only until complete (see `_HoldForward`).
    if window is None:
      group_size = m
    else:
      group_size = window if recompute else len(self.cells)
    group_done = []
    acc = [None] * len(leaves)  # Running sums of the batched weight grads.
    batcher = None
    for t in range(m):
      if t % group_size == 0:
        batcher = matmul_grad.WeightGradientBatcher(leaves)
      with tf.device(self.devices[i]), tf.name_scope('%s_mb%d' % (name, t)):
        outs = _Flat(self.cell_out[i][t])
        idx = [k for k, (o, g) in enumerate(zip(outs, dy[t]))
               if g is not None and _IsFloat(o)]
        x = self.cell_in[i][t]
        flat_x = _Flat(x)
        if idx:
          if recompute:
            gates = [dy[t][k] for k in idx]
            if window is not None and t >= window:
              gates += [g for g in (done[t - window],
                                    group_done[(t - window) // group_size])
                        if g is not None]
            with tf.control_dependencies(gates):
              x_r = [
                  None if v is None else tf.identity(v, name='recompute_gate')
                  for v in flat_x
              ]
            # The same step and the same names under a fresh scope: the
            # same random seeds as the forward pass (see CellRandomness).
            # A recomputation is no further micro-batch: the cell's
            # accumulators keep what its forward passes made of them.
            cell = self.cells[i][1]
            saved_accs = cell.GetAccumulatorValues()
            y_r = _Flat(self._CellFProp(
                i, tf.nest.pack_sequence_as(x, x_r), self.steps[t],
                'recompute')[0])
            cell.SetAccumulatorValues(saved_accs)
            ys = [y_r[k] for k in idx]
          else:
            x_r = flat_x
            ys = [outs[k] for k in idx]
          with batcher:
            dx[t], tg, dys = _CellGradients(ys, x_r, leaves,
                                            [dy[t][k] for k in idx])
          theta_grads.append(tg)
          done[t] = _Group(dx[t] + tg + dys)
      if (t + 1) % group_size == 0 or t == m - 1:
        with tf.device(self.devices[i]), tf.name_scope(
            '%s_mb%d/weight_grad' % (name, t)):
          batched = batcher.Gradients(leaves)
          if window is None:
            theta_grads.append(batched)
            group_done.append(_Group(batched))
          else:
            # Summed group by group, and the next group's backward waits for
            # the sum: weight-sized parts never pile up with M.
            acc = [matmul_grad.SumGradients([a, b])
                   for a, b in zip(acc, batched)]
            group_done.append(_Group(acc))
    if window is not None:
      theta_grads.append(acc)
    if window is not None and not recompute:
      self._HoldForward(i, window, group_size, done, group_done)
    # Flat dy of the previous cell's outputs = flat dx of this cell's inputs.
    return [[None] * len(_Flat(self.cell_in[i][t])) if dx[t] is None else
            dx[t] for t in range(m)]

  def _HoldForward(self, i, window, group_size, done, group_done):
    """Cell i's forward of micro-batch t waits for its backward of t - W.

    And for the batched weight gradient of every group of micro-batches
    complete by then (those MatMuls read the groups' weight-matmul inputs and
    output gradients). So at most W micro-batches' activations are alive in
    cell i, plus, for at most group_size - 1 more, the operands of their
    group's one weight-gradient MatMul; nothing is recomputed. No cycle:
    backward(i, t) needs only forward ops of micro-batches <= t (and the
    caller's dy, which needs none, see `_DyDependsOnForward`), and every edge
    added here goes from micro-batches <= t - W to the forward of t. Graph
    mode: the edges must be added before the graph first runs, as
    tf.gradients is.
    """
    gates = self.gates[i]
    for t in range(1, self.num_micro):
      # In order: what held back t - 1 holds back t.
      deps = [gates[t - 1]]
      if t >= window:
        complete = (t - window + 1) // group_size
        deps += [done[t - window], group_done[complete - 1] if complete else None]
      for d in deps:
        if d is not None:
          internal_tf.AddControlInput(gates[t], d)


class _ListEngine(_Engine):
  """Runs a schedule's per-device action lists (`actions.py`).

  Every action has a gate (a NoOp its ops wait for) and a completion (an op
  that runs once its ops have): each action's gate waits for the completion
  of the action before it on its device, so each device runs its list in
  order, while TensorFlow's executor still runs devices side by side. The
  lists are checked for deadlock under the same dependencies before any
  graph is built (`actions.CheckSchedule`). Nothing is recomputed: each
  (cell, micro-batch) forward subgraph is differentiated as built, and a
  'W' action is the batched weight-gradient MatMul of its micro-batch
  (`matmul_grad.WeightGradientBatcher`), split from its 'I'.
  """

  def __init__(self, layer, theta, inputs, num_micro, schedule_name):
    super().__init__(layer, theta, inputs, num_micro, recompute=False)
    self.gated = True
    self.schedule_name = schedule_name
    num_devices = len(set(self.devices))
    self.spec = actions.StageSpec(len(self.cells), num_devices, num_micro)
    self.schedule = actions.Build(schedule_name, self.spec)

  def _Backward(self, out_grads):
    p = self.p
    m = self.num_micro
    num_cells = len(self.cells)
    out_grads = self._DropZeroGrads(out_grads)
    if self._DyDependsOnForward(out_grads):
      # No output gradient before every forward pass has run: each device
      # runs its forward actions first, then the schedule's backward order.
      tf.logging.info(
          '%s: the loss is not linear in the pipeline\'s outputs; schedule '
          '%r runs every forward pass before its backward actions.', p.name,
          self.schedule_name)
      self.schedule = actions.ForwardsFirst(self.schedule)
      actions.CheckSchedule(self.spec, self.schedule)
    gates, completions = {}, {}
    for i in range(num_cells):
      for t in range(m):
        gates[actions.Action('F', i, t)] = self.gates[i][t]
    with tf.get_default_graph().colocate_with(None, ignore_existing=True):
      dy = self._MicroBatchOutputGrads(out_grads)
      sums = [None] * num_cells
      for i in reversed(range(num_cells)):
        dy, sums[i] = self._ListCellBackward(i, dy, gates, completions)
      for i in range(num_cells):
        for t in range(m):
          with tf.device(self.devices[i]):
            completions[actions.Action('F', i, t)] = _Group(
                _Flat(self.cell_out[i][t]))
      self._Wire(gates, completions)
      return (self._InputGrads(dy) +
              [g for cell_sums in sums for g in cell_sums])

  def _ListCellBackward(self, i, dy, gates, completions):
    """Cell i's 'B' (or 'I' and 'W') actions; returns (dx, theta grads)."""
    m = self.num_micro
    name = self.cells[i][0]
    leaves = self.thetas[i].Flatten()
    split = self.schedule_name == 'zero_bubble'
    dx = [None] * m
    acc = [None] * len(leaves)

    def Add(parts):
      """Adds parts to the running sums; returns the sums it changed.

      An action's completion includes its sums, so the next action on the
      device waits for them and each micro-batch's weight-sized part is freed
      once added. Grappler also leaves an add that drives a control edge as it
      is; a chain of plain adds it folds into one AddN of all M parts, every
      part alive until the last (FC 8 x 512, 2 cells, M = 32: 1149 MB against
      'unrolled''s 878 MB).
      """
      changed = []
      for k, g in enumerate(parts):
        if g is not None:
          acc[k] = matmul_grad.SumGradients([acc[k], g])
          changed.append(acc[k])
      return changed

    for t in range(m):
      b = actions.Action('I' if split else 'B', i, t)
      with tf.device(self.devices[i]), tf.name_scope('%s_mb%d' % (name, t)):
        gate = tf.no_op(name='bwd_gate')
        gates[b] = gate
        outs = _Flat(self.cell_out[i][t])
        idx = [k for k, (o, g) in enumerate(zip(outs, dy[t]))
               if g is not None and _IsFloat(o)]
        flat_x = _Flat(self.cell_in[i][t])
        batcher = matmul_grad.WeightGradientBatcher(leaves)
        tg, batched = [None] * len(leaves), [None] * len(leaves)
        dys = []
        if idx:
          with tf.control_dependencies([gate]):
            grad_ys = [tf.identity(dy[t][k]) for k in idx]
          with batcher:
            dx[t], tg, dys = _CellGradients([outs[k] for k in idx], flat_x,
                                            leaves, grad_ys)
        if split:
          completions[b] = _Group((dx[t] or []) + tg + dys + Add(tg)) or gate
          w = actions.Action('W', i, t)
          with tf.name_scope('weight_grad'):
            w_gate = tf.no_op(name='w_gate')
            gates[w] = w_gate
            with tf.control_dependencies([w_gate]):
              batched = batcher.Gradients(leaves)
              completions[w] = _Group(batched + Add(batched)) or w_gate
        else:
          batched = batcher.Gradients(leaves)
          completions[b] = _Group((dx[t] or []) + tg + dys + batched +
                                  Add(tg) + Add(batched)) or gate
    dx = [[None] * len(_Flat(self.cell_in[i][t])) if dx[t] is None else dx[t]
          for t in range(m)]
    return dx, acc

  def _Wire(self, gates, completions):
    """Each action's gate waits for the previous action on its device."""
    for device_actions in self.schedule:
      for prev, a in zip(device_actions, device_actions[1:]):
        internal_tf.AddControlInput(gates[a], completions[prev])


def ListSchedule(name):
  """The schedule function that runs `actions.ACTION_SCHEDULES[name]`."""

  def Schedule(layer, theta, inputs, num_micro):
    if layer.params.recompute:
      raise ValueError(
          '%s: schedule=%r does not recompute; set recompute=None or False, '
          "or use '1f1b' or 'unrolled' with recompute=True." %
          (layer.params.name, name))
    return _ListEngine(layer, theta, inputs, num_micro, name).Build()

  Schedule.__name__ = name
  Schedule.__doc__ = actions.ACTION_SCHEDULES[name].__doc__
  return Schedule


def Unrolled(layer, theta, inputs, num_micro):
  """One subgraph per (micro-batch, cell); see the module docstring."""
  return _Engine(layer, theta, inputs, num_micro,
                 recompute=bool(layer.params.recompute)).Build()


def OneFOneB(layer, theta, inputs, num_micro):
  """1F1B: at most K - i micro-batches in flight in cell i's backward pass."""
  num_cells = len(layer.Cells())
  return _Engine(layer, theta, inputs, num_micro,
                 recompute=layer.params.recompute,
                 window=lambda i: num_cells - i).Build()


def Recurrent(layer, theta, inputs, num_micro):
  """Lingvo's StackedRecurrent loop over micro-batches (always recomputes)."""
  p = layer.params
  cells = layer.Cells()
  num_cells = len(cells)
  micro_batch_size = None
  for x in _Flat(inputs):
    if x is not None:
      micro_batch_size = x.shape.as_list()[p.batch_dim] // num_micro
      break
  state_dtype = layer.StateDtype(inputs)
  if p.fprop_dtype is not None:
    # Cells that compute in fprop_dtype (Lingvo's mixed precision, e.g.
    # bfloat16) pass their outputs on in it, and StackedRecurrent takes one
    # dtype for all of a cell's states, the micro-batch step included (in
    # bfloat16 exact up to 256, as with Lingvo's state_dtype=tf.bfloat16).
    state_dtype = p.fprop_dtype
  state_shapes = layer.StateShapes(inputs, micro_batch_size,
                                    after_before_layers=True)
  devices = layer.Devices()

  def _CellFn(i):
    """The step function of cell i inside StackedRecurrent."""

    def CellFn(theta, state0, inputs):
      del state0

      def _SetShape(name, t_shape):
        if t_shape is None:
          return None
        t = inputs.GetItem(name)
        t.set_shape(t_shape.ToTensorShape().as_list())
        return t

      fprop_inputs = layer.FromState(inputs, state_shapes[i], _SetShape)
      with py_utils.RemoveAssertContext(remove=True):
        with lingvo_gpipe.CellFnFPropOpReplacementWrapper():
          mb_tensor = inputs[_MICRO_BATCH_STATE_NAME]
          lingvo_gpipe.SetOverWriteGlobalStep(mb_tensor)
          _, cell = cells[i]
          outputs = cell.FProp(theta, *ToTuple(fprop_inputs))
      if not p.nested_map_fprop and (len(ToTuple(outputs)) != len(
          state_shapes[i + 1])):
        raise ValueError(
            '%s: cell %d returned %d outputs but its FPropMeta says %d.' %
            (p.name, i, len(ToTuple(outputs)), len(state_shapes[i + 1])))
      state1 = layer.ToState(outputs)
      state1[_MICRO_BATCH_STATE_NAME] = mb_tensor
      return state1, py_utils.NestedMap()

    return CellFn

  def _Zeros(t_shape):
    if t_shape is None:
      return None
    return tf.zeros(t_shape.ToTensorShape().as_list(), dtype=state_dtype)

  init_states = []
  for i in range(num_cells):
    if p.nested_map_fprop:
      init_state = py_utils.Transform(_Zeros, state_shapes[i + 1])
    else:
      init_state = tuple(_Zeros(s) for s in state_shapes[i + 1])
    init_state = layer.ToState(init_state)
    init_state[_MICRO_BATCH_STATE_NAME] = tf.cast(0, dtype=state_dtype)
    init_states.append(init_state)

  with tf.device(devices[0]):

    def _Split(x):
      if x is None:
        return None
      return tf.stack(tf.split(x, num_micro, axis=p.batch_dim))

    if p.nested_map_fprop:
      states = layer.ToState(py_utils.Transform(_Split, inputs[0]))
    else:
      states = layer.ToState(tuple(_Split(x) for x in inputs))
    states[_MICRO_BATCH_STATE_NAME] = tf.stack(
        layer.MicroBatchSteps(num_micro, state_dtype))

  cell_thetas = []
  for i, (name, _) in enumerate(cells):
    with tf.device(devices[i]):
      cell_thetas.append(theta[name].Transform(CastHere))

  output_state, _ = recurrent.StackedRecurrent(
      devices=devices,
      cell_fns=[_CellFn(i) for i in range(num_cells)],
      cell_grads=[None] * num_cells,
      cell_outs=[lambda x: x] * num_cells,
      cell_out_grads=[lambda x: x] * num_cells,
      thetas=cell_thetas,
      init_states=init_states,
      inputs=states,
      accumulator_layers=[cell for _, cell in cells],
      unused_acc_state=True)

  with tf.device(devices[-1]):

    def _Merge(name, t_shape):
      """[M, micro-batch...] -> the batch, with batch_dim restored."""
      if t_shape is None:
        return None
      out = output_state.GetItem(name)
      if p.batch_dim != 0:
        perm = list(range(1, p.batch_dim + 1)) + [0]
        perm += list(range(p.batch_dim + 1, t_shape.rank + 1))
        out = tf.transpose(out, perm=perm)
      shape = t_shape.ToTensorShape().as_list()
      shape[p.batch_dim] *= num_micro
      return tf.reshape(out, shape)

    outputs = layer.FromState(output_state, state_shapes[-1], _Merge)
  if not p.nested_map_fprop and len(outputs) == 1:
    return outputs[0]
  return outputs


# Schedules by name: PipeliningLayer's `schedule` param picks one.
SCHEDULES = {
    'unrolled': Unrolled,
    '1f1b': OneFOneB,
    'recurrent': Recurrent,
    'interleaved_1f1b': ListSchedule('interleaved_1f1b'),
    'zero_bubble': ListSchedule('zero_bubble'),
}
# Schedules that always re-materialise (recompute=False is an error there).
ALWAYS_RECOMPUTE = ('recurrent',)
# Schedules that overlap forward and backward passes only for a loss linear
# in the pipeline's outputs; for other losses they run every forward pass
# first (`actions.ForwardsFirst`), without recomputing.
LINEAR_LOSS_ONLY = ('interleaved_1f1b', 'zero_bubble')
