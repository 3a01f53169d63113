"""Pipeline schedules: how micro-batches flow through a PipeliningLayer's cells.

A schedule is a function with one signature,

  Schedule(layer, theta, inputs, num_micro_batches) -> outputs

where `layer` is the `gpipe.PipeliningLayer` (its cells, devices and params),
`theta` its weights, `inputs` the tuple of FProp inputs after the layer's
`before_tpl` layers and `outputs` the last cell's outputs for the whole batch.
`PipeliningLayer` picks one from `SCHEDULES` by its `schedule` param; a new
schedule is one new entry there.

Every schedule but 'recurrent' is data: `actions.ACTION_SCHEDULES[name]`
gives each device's ordered list of actions, and `_Engine` builds them (a
forward pass per cell and micro-batch on the cell's device; the backward
pass, inside the pipeline's custom gradient, per action):

- 'unrolled': GPipe's lists (`actions.GPipe`): all forward passes, then the
  input gradients, then one run of weight gradients per cell, which is one
  MatMul per weight over all micro-batches' rows. No action waits for the
  one before it on its device (`actions.ORDERED_KINDS`) but a
  recomputation, so TensorFlow's executor overlaps cells as data arrives.
  With `recompute=True`, each cell's forward pass is re-materialised in its
  backward pass, micro-batch by micro-batch, and the weight gradients come
  in runs whose recomputed activations stay within a copy of the weights
  (`_Engine._WeightGradientRun`).
- '1f1b': 1F1B's lists (`actions.OneFOneBGroupedWeights`), weight gradients
  in runs of K micro-batches, longer where the weights outweigh the MatMul
  operands the runs keep (`_Engine._WeightGradientRun`); each forward pass
  waits for the action before it, so cell i has at most K - i micro-batches
  in flight and activation memory is bounded by K and the runs, not M. When
  the caller's output gradients do not need the forward pass (a loss linear
  in the outputs, e.g. per-example losses from the last cell, summed), a
  micro-batch's backward pass starts as soon as its forward pass leaves the
  last cell and nothing is recomputed. Otherwise no backward pass can start
  before every forward pass ends: the forward pass keeps only cell-boundary
  activations and each cell alternates one recomputed forward and one
  backward micro-batch. Checked when tf.gradients builds the backward pass
  (`recompute=None`).
- 'recurrent': Lingvo's `StackedRecurrent` loop, which always recomputes.
- 'interleaved_1f1b', 'zero_bubble': each device runs its list strictly in
  order (with `recompute=True`, each backward action after its 'R'); for a
  loss not linear in the outputs, its forward actions first
  (`actions.ForwardsFirst`).
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


def _OneOpGradients(ys, xs, grad_ys):
  """tf.gradients(ys, xs, grad_ys, stop_gradients=xs) where that is one op's.

  Where every y is an output of one op (a cell function's call) and every x
  one of its inputs, the op's own gradient (`internal_tf.OpGradients`), in
  time independent of the graph's size; else None.
  """
  op = ys[0].op
  inputs = {t.ref() for t in op.inputs}
  if (any(y.op is not op for y in ys) or
      any(x.ref() not in inputs for x in xs)):
    return None
  out_grads = [[] for _ in op.outputs]
  for y, g in zip(ys, grad_ys):
    out_grads[y.value_index].append(g)
  with tf.name_scope('gradients'):
    in_grads = internal_tf.OpGradients(
        op, [matmul_grad.SumGradients(g) for g in out_grads])
  # An input the op takes several times gets the sum, as tf.gradients sums.
  by_input = {}
  for x, g in zip(op.inputs, in_grads):
    by_input.setdefault(x.ref(), []).append(g)
  return [matmul_grad.SumGradients(by_input[x.ref()]) for x in xs]


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
  # A cell function's gradient is a function call too.
  with internal_tf.CallsOptimizedOnce():
    grads = _OneOpGradients(ys, xs + leaves + zeros, grad_ys)
    if grads is None:
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
  """Runs a schedule's per-device action lists (`actions.py`) as a graph.

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
    one stage (`actions.WeightGradientRuns`) is one MatMul per weight over
    all its micro-batches' rows (`matmul_grad.WeightGradientBatcher`),
    instead of a weight-sized gradient per micro-batch summed at the end.
  - 'B': 'I' and 'W' of one micro-batch as one action.

  Every action has a gate (a NoOp its ops wait for) and a completion (an op
  that runs once its ops have, its running weight-gradient sums included):
  each action's gate waits for the completion of the action before it on its
  device, so each device runs its list in order, while TensorFlow's executor
  runs the devices side by side. The lists are checked for completeness and
  deadlock under the same dependencies before any graph is built
  (`actions.CheckSchedule`). They are made when tf.gradients builds the
  backward pass: whether the caller's loss lets a backward action start
  before the last forward one (`_DyDependsOnForward`) decides `recompute`
  where it is None and, for a loss that does not, puts each device's forward
  actions first (`actions.ForwardsFirst`).
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
    self.gated = 'F' in actions.ORDERED_KINDS[schedule_name]
    self.num_devices = len(set(self.devices))
    # Checked now, so a bad (K, M) fails at FProp, not in tf.gradients.
    actions.Build(schedule_name, self._Spec(bool(recompute)))
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

  def _Spec(self, recompute: bool, run: int = 1) -> actions.StageSpec:
    return actions.StageSpec(len(self.cells), self.num_devices,
                             self.num_micro, recompute, run)

  def _WeightGradientRun(self) -> int:
    """How many micro-batches a run of 'W's takes ('unrolled' with
    recompute, '1f1b' without): `actions.WeightGradientRunLength` over the
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
    return actions.WeightGradientRunLength(sum(weights.values()), operands,
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

  def _Schedule(self, out_grads):
    """(the StageSpec, recompute decided; the action lists) for these
    output gradients."""
    p = self.p
    depends = self._DyDependsOnForward(out_grads)
    recompute = self.recompute
    if recompute is None:
      # '1f1b' by default: recompute only when the forward passes of all
      # micro-batches must end before any backward pass starts.
      recompute = depends if self.schedule_name == '1f1b' else False
    elif recompute is False and depends and self.schedule_name == '1f1b':
      raise ValueError(
          "%s: schedule='1f1b' with recompute=False needs output gradients "
          "that do not depend on the pipeline's outputs (a loss linear in "
          'them, e.g. per-example losses from the last cell, summed); this '
          'loss is not: set recompute=None (recompute when needed) or True.'
          % p.name)
    run = (self._WeightGradientRun()
           if (self.schedule_name, bool(recompute)) in
           actions.SIZED_WEIGHT_GRADIENT_RUNS else 1)
    spec = self._Spec(recompute, run)
    schedule = actions.Build(self.schedule_name, spec)
    forwards_first = actions.ForwardsFirst(schedule)
    if depends and forwards_first != schedule:
      # No output gradient before every forward pass has run: each device
      # runs its forward actions first, then the schedule's backward order.
      tf.logging.info(
          '%s: the loss is not linear in the pipeline\'s outputs; schedule '
          '%r runs every forward pass before its backward actions.', p.name,
          self.schedule_name)
      schedule = forwards_first
      actions.CheckSchedule(spec, schedule)
    return spec, schedule

  def _Backward(self, out_grads):
    """Gradients of (present inputs, theta leaves) from those of outputs."""
    m = self.num_micro
    num_cells = len(self.cells)
    out_grads = self._DropZeroGrads(out_grads)
    self.spec, self.schedule = self._Schedule(out_grads)
    # Each run of 'W's by its first action.
    self.runs = {run[0]: run
                 for run in actions.WeightGradientRuns(self.schedule)}
    gates, completions = {}, {}
    # What each enforced action waits for, and the actions awaited.
    self.waits = actions.Waits(self.schedule,
                               actions.ORDERED_KINDS[self.schedule_name])
    self.awaited = {a for acts in self.waits.values() for a in acts}
    for i in range(num_cells):
      for t in range(m):
        gates[actions.Action('F', i, t)] = self.gates[i][t]
    with tf.get_default_graph().colocate_with(None, ignore_existing=True):
      dy = self._MicroBatchOutputGrads(out_grads)
      sums = [None] * num_cells
      for i in reversed(range(num_cells)):
        dy, sums[i] = self._CellBackward(i, dy, gates, completions)
      for i in range(num_cells):
        for t in range(m):
          f = actions.Action('F', i, t)
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
    split = actions.Action('I', i, 0) in device_actions
    ordered = actions.ORDERED_KINDS[self.schedule_name]

    def Gate(kind, gate_name):
      """A NoOp the action's ops wait for, where its place is enforced."""
      return tf.no_op(name=gate_name) if kind in ordered else None

    dx = [None] * m
    batchers = [matmul_grad.WeightGradientBatcher(leaves) for _ in range(m)]
    # Per backward action: the tensors its completion includes, and the
    # weight gradients it adds to the running sums.
    own, parts = {}, {}
    for t in range(m):
      b = actions.Action('I' if split else 'B', i, t)
      with tf.device(self.devices[i]), tf.name_scope('%s_mb%d' % (name, t)):
        outs = _Flat(self.cell_out[i][t])
        idx = [k for k, (o, g) in enumerate(zip(outs, dy[t]))
               if g is not None and _IsFloat(o)]
        flat_x = _Flat(self.cell_in[i][t])
        if recompute:
          r = actions.Action('R', i, t)
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
            dx[t], tg, dys = _CellGradients([outs[k] for k in idx], flat_x,
                                            leaves, grad_ys)
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
    """Each enforced action's gate (`actions.ORDERED_KINDS`) waits for the
    actions before it on its device (`actions.Waits`)."""
    for a, awaited in self.waits.items():
      done = []
      for prev in awaited:
        if all(completions[prev] is not d for d in done):
          done.append(completions[prev])
          internal_tf.AddControlInput(gates[a], completions[prev])


def ListSchedule(name):
  """The schedule function that runs `actions.ACTION_SCHEDULES[name]`.

  The layer's `recompute` goes to the engine as it is: None lets '1f1b'
  recompute only for a loss not linear in the outputs, and the other
  schedules not at all; True adds each backward action's recomputation
  ('R') to the lists.
  """

  def Schedule(layer, theta, inputs, num_micro):
    return _Engine(layer, theta, inputs, num_micro, name,
                   layer.params.recompute).Build()

  Schedule.__name__ = name
  Schedule.__doc__ = actions.ACTION_SCHEDULES[name].__doc__
  return Schedule


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
    'unrolled': ListSchedule('unrolled'),
    '1f1b': ListSchedule('1f1b'),
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
