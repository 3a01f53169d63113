"""Weight gradients: one owner per cell, `CellWeightGradients`.

A cell's weight MatMuls (and lookups of a weight's rows) leave their weight
gradients out of the cell's backward pass ('I' or 'B'); their operands
(x, dy) go to the cell's `CellWeightGradients`, which computes each weight's
gradient x^T dy once per run of 'W' actions (one MatMul over the run's
micro-batches' rows) and keeps the running sums, in its device's order.

The operands arrive two ways. A cell function exports each use's operands
as outputs of its call (cell_function.py); `CellGradients` hands them to the
owner directly. An inline cell's ops are differentiated by tf.gradients,
which calls each op's registered gradient function with (op, grad) and
nothing else: the only way a MatMul's gradient can hand its operands to the
owner is a context it reads while tf.gradients runs, so the owner is also a
`matmul_grad.WeightGradientBatcher` entered around the call
(matmul_grad.py's thread-local stack). A MatMul whose right operand is no
weight of the cell (two activations) gets TensorFlow's gradient.
"""

import lingvo.compat as tf

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.pipeline import cell_function
from lingvo_ext.pipeline import graph_state
from lingvo_ext.pipeline import matmul_grad
from lingvo_ext.pipeline import runs
from lingvo_ext.pipeline.tensors import IsFloat

# Graph state (graph_state): (device, dtype, shape) -> a shared zero gradient.
_ZEROS = 'engine_zero_grads'


def OneOpGradients(ys, xs, grad_ys):
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
  out_grads = [matmul_grad.SumGradients(g) for g in out_grads]
  out_grads = [_SharedZeros(y) if g is None else g
               for y, g in zip(op.outputs, out_grads)]
  with tf.name_scope('gradients'):
    in_grads = internal_tf.OpGradients(op, out_grads)
  # An input the op takes several times gets the sum, as tf.gradients sums.
  by_input = {}
  for x, g in zip(op.inputs, in_grads):
    by_input.setdefault(x.ref(), []).append(g)
  return [matmul_grad.SumGradients(by_input[x.ref()]) for x in xs]


def _SharedZeros(y):
  """The zero gradient of float output `y` (of static shape) of a call: one
  constant per (device, dtype, shape) for all calls, not a ZerosLike per
  call and output (the exported operands and accumulators of every
  (cell, micro-batch)). None for other outputs (OpGradients makes theirs)."""
  if not y.dtype.is_floating or not y.shape.is_fully_defined():
    return None
  cache = graph_state.Get(y.graph, _ZEROS, dict)
  key = (y.op.device, y.dtype, tuple(y.shape.as_list()))
  if key not in cache:
    with tf.device(y.op.device), tf.control_dependencies(
        None), y.graph.colocate_with(None, ignore_existing=True), tf.name_scope(
            'cell_zero_grads/'):
      cache[key] = tf.zeros(y.shape, y.dtype)
  return cache[key]


def CellGradients(ys, flat_x, leaves, grad_ys, batcher):
  """One cell's backward pass on one micro-batch.

  Args:
    ys: The cell's outputs that have gradients.
    flat_x: The cell's flat inputs (None entries allowed).
    leaves: The cell's theta leaves.
    grad_ys: The gradients of `ys`.
    batcher: The micro-batch's `matmul_grad.WeightGradientBatcher` of
      `leaves`, entered: the operands of the cell's weight uses go to it.

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
    if not IsFloat(v) or v.ref() in seen:
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
    grads = OneOpGradients(ys, xs + leaves + zeros, grad_ys)
    if grads is None:
      grads = tf.gradients(ys, xs + leaves + zeros, grad_ys=grad_ys,
                           stop_gradients=xs + leaves)
  it = iter(grads[:len(xs)])
  leaf_grads = grads[len(xs):len(xs) + len(leaves)]
  exported_dys = grads[len(xs) + len(leaves):]
  for e, dy in zip(operands, exported_dys):
    if dy is not None:
      batcher.AddOperands(e.weight, e.operand, dy, e.rows)
  return ([None if v is None else next(it) for v in diff_x], leaf_grads,
          [dy for dy in exported_dys if dy is not None])


class CellWeightGradients:
  """The weight gradients of one cell: its operands, runs and running sums.

  Per micro-batch, a batcher collects the operands of the cell's weight uses
  in its backward pass (`Backward`); `Run` computes a run of micro-batches'
  weight gradients as one MatMul per weight; `Add` adds an action's
  gradients to the running sums as the action completes; `Totals` are the
  cell's theta gradients.
  """

  def __init__(self, leaves, num_micro: int, ordered):
    """`ordered`: the action kinds whose place the schedule enforces."""
    self.leaves = leaves
    self.batchers = [matmul_grad.WeightGradientBatcher(leaves)
                     for _ in range(num_micro)]
    self._ordered = ordered
    self._acc = [None] * len(leaves)
    self._rest = [[] for _ in leaves]

  def Backward(self, t, ys, flat_x, grad_ys):
    """`CellGradients` of micro-batch t, its weights' operands collected."""
    with self.batchers[t]:
      return CellGradients(ys, flat_x, self.leaves, grad_ys, self.batchers[t])

  def Run(self, micro_batches):
    """The weight gradients of these micro-batches: one MatMul per weight."""
    if len(micro_batches) == 1:
      batcher = self.batchers[micro_batches[0]]
    else:
      batcher = matmul_grad.WeightGradientBatcher.Merged(
          self.leaves, [self.batchers[t] for t in micro_batches])
    return batcher.Gradients(self.leaves)

  def Add(self, kind, parts, scope):
    """Adds an action's gradients to the running sums; returns the sums
    changed (what the action's completion includes).

    Each batched weight gradient (a run's or a 'B''s), and every part of an
    enforced action, is added as its action completes, in the device's
    order (so no sum waits for an action that comes later there), and the
    next action on the device waits for the sum: each weight-sized part is
    freed once added. (Grappler leaves an add that drives a control edge as
    it is; a chain of plain adds it folds into one AddN of all parts, every
    part alive until the last.) The other parts (an unenforced action's
    gradients of weights used other than by MatMuls: biases, scales) go
    into one AddN in `Totals`.

    Args:
      kind: The action's kind.
      parts: [(gradients aligned with the leaves, whether batched)].
      scope: The name scope of the sums.
    """
    changed = []
    for grads, batched in parts:
      for k, g in enumerate(grads):
        if g is None:
          continue
        if not batched and kind not in self._ordered:
          self._rest[k].append(g)
          continue
        with tf.name_scope(scope):
          self._acc[k] = matmul_grad.SumGradients([self._acc[k], g])
        changed.append(self._acc[k])
    return changed

  def Totals(self, scope):
    """The cell's theta gradients (None where it has none)."""
    with tf.name_scope(scope):
      return [matmul_grad.SumGradients([a] + r) if r else a
              for a, r in zip(self._acc, self._rest)]


def RunLength(first_outputs, num_micro: int) -> int:
  """How many micro-batches' weight gradients a run computes
  (`runs.WeightGradientRunLength`) over the MatMuls the cells' functions
  export; 1 where none does (cells built inline).

  Args:
    first_outputs: Per cell, its flat outputs of the first micro-batch.
    num_micro: M.
  """
  weights, operands = {}, 0
  for outs in first_outputs:
    outs = [o for o in outs if o is not None]
    for use in (cell_function.ExportedOperands(outs[0].op) if outs else []):
      # A lookup: its gradient is sparse, not weight-sized; a bias: its dy is
      # its product's.
      if use.rows:
        continue
      sizes = [use.weight.shape.num_elements(),
               use.operand.shape.num_elements(),
               use.zero.shape.num_elements()]
      if None in sizes:
        return 1
      weights[use.weight.ref()] = sizes[0]
      operands += sizes[1] + sizes[2]
  return runs.WeightGradientRunLength(sum(weights.values()), operands,
                                      num_micro)
