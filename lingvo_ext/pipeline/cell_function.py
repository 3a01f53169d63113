"""A pipeline cell built once: one TF function called per micro-batch.

`CellFunction` traces a cell's FProp once as a function of (theta, inputs,
micro-batch step, accumulator values) and returns a call per micro-batch, so a
pipeline's graph holds each cell's ops once plus one call op per (cell,
micro-batch), instead of a copy of the cell per micro-batch. TensorFlow
differentiates the call op with the function's own gradient function, also
built once, so the backward pass grows the same way.

Weight gradients are left out of the function's backward pass: each MatMul
(or BatchMatMul broadcasting a [in, out] weight) of an activation by a weight
(a theta leaf) exports its left operand x as an
output and adds to its product a zero the call takes, whose gradient is then
the product's gradient dy (`ExportedOperands`). The engine computes the
weight's gradient x^T dy once over the micro-batches of a group
(`matmul_grad.WeightGradientBatcher`), as it does for inline cells: one
weight-sized MatMul instead of one per micro-batch summed at the end. A
bias added to such a product shares its zero (`_ExportBias`): the engine sums
dy over the same rows once (a [1, rows] GEMM), where the backward function
would reduce it per micro-batch. A
lookup of a weight's rows (an embedding's gather) exports its ids the same
way, so the weight's gradient stays sparse (IndexedSlices of dy's rows), as
inline; a function would return it dense, vocabulary-sized per micro-batch.

Numeric checks: where the pipeline checks its outputs and gradients once per
step (`check_numerics='step'`), a cell is built inside `CellChecks(False)`,
which turns Lingvo's `py_utils.CheckNumerics` off for the ops built inside
(and so their gradients' checks), for functions and inline cells alike.

Random ops seed as in Lingvo's `StackedRecurrent` loop: the function body is a
graph of its own, so an op's name scope inside it, and so its seed, is the one
it has in Lingvo's loop, and the micro-batch step (an input) replaces the
global step (`lingvo.core.gpipe.SetOverWriteGlobalStep`).
"""

import collections
import contextlib
import re
from typing import List

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils
from lingvo.core import py_utils_flags
import tensorflow as tf2

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.pipeline import gemm_rewrite
from lingvo_ext.pipeline import graph_state
from lingvo_ext.pipeline import jit_random
from lingvo_ext.pipeline import matmul_grad
from lingvo_ext.pipeline import nest_util

# Graph state (graph_state): a call's op name -> its exported operands.
_OPERANDS = 'cell_function_operands'
# Graph state: (cell, jit_compile, input signature) -> its CellFunction.
_FUNCTIONS = 'cell_functions'

# One weight use whose gradient a call leaves out. `zero` (a call input) is
# added to the use's output, so a loss's gradient with respect to it is the
# output's gradient dy. For a MatMul x @ weight: `operand` is x as [rows, in]
# (a call output), `zero` is [rows, out] and the gradient is x^T dy. For a
# lookup gather(weight, ids) (`rows`): `operand` is the ids as a vector,
# `zero` is [ids, ...] and the gradient is IndexedSlices(dy, ids).
# A bias added to a weight MatMul's product (`rows` BIAS, `operand` None)
# shares the MatMul's `zero`: its gradient is dy summed over the rows.
Exported = collections.namedtuple('Exported', 'weight operand zero rows')
BIAS = matmul_grad.BIAS


def ExportedOperands(op) -> List[Exported]:
  """The weight uses whose gradient the call that made `op` leaves out.

  Empty for any op but a cell function's call.
  """
  return graph_state.Peek(op.graph, _OPERANDS, {}).get(op.name, [])


@contextlib.contextmanager
def CellChecks(keep: bool):
  """Inside: Lingvo's numeric checks as the cluster and flags say if `keep`,
  else none (the pipeline checks its outputs and gradients once a step)."""
  if keep or not py_utils_flags.enable_check_numerics():
    yield
    return
  with cluster_factory.Current().params.Copy().Set(
      enable_check_numerics=False).Instantiate():
    yield


def _Signature(theta, inputs, step):
  """What a trace depends on: the arguments' structures, dtypes, shapes."""
  def Leaf(t):
    if t is None:
      return None
    return t.dtype.name, (None if t.shape.rank is None else
                          tuple(t.shape.as_list()))
  return (repr(tf.nest.map_structure(lambda _: 0, (theta, inputs))),
          tuple(Leaf(t) for t in nest_util.Flat((theta, inputs, step))))


def ForCell(cell, name: str, jit_compile: bool, theta, inputs, step,
            flat_weight_matmuls: bool = True, cell_checks: bool = True):
  """The graph's CellFunction of `cell` for inputs like these.

  Each FProp of a pipeline in one graph (a pipeline called twice, or the
  same cells under several schedules) calls the same traced function and
  its gradient, instead of tracing both again.
  """
  cache = graph_state.Get(tf.get_default_graph(), _FUNCTIONS, dict)
  # The CellFunction holds `cell`, so its id stays its own while cached.
  key = (id(cell), bool(jit_compile), bool(flat_weight_matmuls),
         bool(cell_checks), _Signature(theta, inputs, step))
  if key not in cache:
    cache[key] = CellFunction(cell, name, jit_compile, flat_weight_matmuls,
                              cell_checks)
  return cache[key]


def _ExportBias(y_z, leaf_index):
  """The theta leaf index of a bias added to an exported product, or None.

  `y_z` is a weight MatMul's product plus its zero. Where its one consumer
  (through Reshapes, each the one consumer of the last) adds a rank-1 theta
  leaf along the last axis, that add's output gradient is the zero's
  gradient reshaped, so the bias's gradient is the zero's summed over its
  rows: the engine computes it once over a run's micro-batches with the
  weight's (`matmul_grad.WeightGradientBatcher`), and the add passes the
  bias on without a gradient, so the backward function sums none per
  micro-batch.
  """
  t = y_z
  while True:
    consumers = t.consumers()
    if len(consumers) != 1 or len(consumers[0].outputs) != 1:
      return None
    c = consumers[0]
    if c.type != 'Reshape':
      break
    if c.inputs[0].ref() != t.ref():
      return None
    t = c.outputs[0]
  if c.type not in ('AddV2', 'Add', 'BiasAdd') or (
      c.type == 'BiasAdd' and c.get_attr('data_format') != b'NHWC'):
    return None
  idx = [j for j, u in enumerate(c.inputs) if u.ref() == t.ref()]
  if len(idx) != 1 or c.type == 'BiasAdd' and idx != [0]:
    return None
  j = 1 - idx[0]
  b = matmul_grad.ThroughIdentities(c.inputs[j], leaf_index)
  out = c.outputs[0]
  if (b is None or b.dtype != t.dtype or b.shape.rank != 1 or
      not t.shape.is_fully_defined() or out.shape != t.shape or
      b.shape[0] != t.shape[-1]):
    return None
  internal_tf.UpdateInput(c, j, tf.stop_gradient(c.inputs[j]))
  return leaf_index[b.ref()]


class CellFunction:
  """One cell's FProp as a function called once per micro-batch.

  The function takes the cell's theta leaves, its present (non-None) inputs,
  the micro-batch step, the global step's value and the cell's accumulator
  values, and returns its
  present outputs and the new accumulator values. It is traced on the first
  call; later calls must give inputs of the same structure, dtypes and
  shapes (every micro-batch of a pipeline does).
  """

  def __init__(self, cell, name: str, jit_compile: bool = False,
               flat_weight_matmuls: bool = True, cell_checks: bool = True):
    """Constructor.

    Args:
      cell: The cell layer (its FProp takes theta and the cell's inputs).
      name: Name of the function (unique per cell in a graph helps reading).
      jit_compile: Compile the function with XLA.
      flat_weight_matmuls: Run broadcasting weight matmuls as 2-D GEMMs
        (gemm_rewrite.py).
      cell_checks: Keep Lingvo's numeric checks in the cell (`CellChecks`).
    """
    self._cell = cell
    self._name = name
    self._jit_compile = jit_compile
    self._flat_weight_matmuls = flat_weight_matmuls
    self._cell_checks = cell_checks
    self._fn = None
    self._global_step = None
    self._theta_struct = None
    self._in_struct = None
    self._out_struct = None  # The cell's output structure, None kept.
    self._acc_struct = None
    self._exported = []  # [(theta leaf index, zero, rows)] per weight use.
    self._unexported_lookups = None  # HasUnexportedLookups, once traced.

  def _Trace(self, theta, inputs, step):
    """Builds the tf.function for these input structures."""
    cell = self._cell
    self._traced_args = (theta, inputs, step)
    self._theta_struct = theta
    self._in_struct = inputs
    self._acc_struct = cell.GetAccumulatorValues()
    n_theta = len(nest_util.Flat(theta))
    in_flat = nest_util.Flat(inputs)
    present = [i for i, x in enumerate(in_flat) if x is not None]
    n_in = len(present)
    n_acc = len(nest_util.Flat(self._acc_struct))
    self._has_global_step = py_utils.GetGlobalStep() is not None

    def Body(*args):
      theta_b = tf.nest.pack_sequence_as(self._theta_struct,
                                         list(args[:n_theta]))
      xs = [None] * len(in_flat)
      for i, x in zip(present, args[n_theta:n_theta + n_in]):
        xs[i] = x
      x_b = tf.nest.pack_sequence_as(self._in_struct, xs)
      step_b = args[n_theta + n_in]
      rest = list(args[n_theta + n_in + 1:])
      # The global step comes in as a value, not as a captured variable
      # (which XLA cannot read from another device).
      global_step = rest.pop(0) if self._has_global_step else None
      accs = rest
      if n_acc:
        cell.SetAccumulatorValues(
            tf.nest.pack_sequence_as(self._acc_struct, list(accs)))
      with contextlib.ExitStack() as stack:
        if global_step is not None:
          stack.enter_context(py_utils.GlobalStepContext(global_step))
        if self._jit_compile:
          # Lingvo's shape asserts and numeric checks have no XLA kernels.
          stack.enter_context(cluster_factory.Current().params.Copy().Set(
              enable_asserts=False,
              enable_check_numerics=False).Instantiate())
        else:
          stack.enter_context(CellChecks(self._cell_checks))
        stack.enter_context(lingvo_gpipe.CellFnFPropOpReplacementWrapper())
        lingvo_gpipe.SetOverWriteGlobalStep(step_b)
        stack.enter_context(py_utils.RemoveAssertContext(remove=True))
        stack.enter_context(matmul_grad.CellMatMulGradients())
        first_op = len(tf.get_default_graph().get_operations())
        # Before the exports: a rewritten product is a MatMul they see.
        out = gemm_rewrite.Flattened(
            lambda: cell.FProp(theta_b, *nest_util.ToTuple(x_b)),
            self._flat_weight_matmuls)
      if self._jit_compile:
        # XLA turns Philox bits into floats otherwise than TF's kernels.
        jit_random.MatchStatelessUniforms(
            tf.get_default_graph().get_operations()[first_op:])
      new_accs = nest_util.Flat(cell.GetAccumulatorValues()) if n_acc else []
      out, new_accs, xs = self._ExportWeightUses(
          first_op, list(args[:n_theta]), out, new_accs)
      self._out_struct = out
      out_flat = [t for t in nest_util.Flat(out) if t is not None]
      return out_flat + new_accs + xs

    def Unplaced(*args):
      # XLA runs the body on the call's device. A device inside it (Lingvo's
      # placer) lets Grappler's remapper fuse ops into kernels XLA lacks
      # (_FusedConv2D) when it optimizes the function library.
      with tf.device(None):
        return Body(*args)

    # Not inlined into the calling graph when the session lowers function
    # calls: each call stays one node, so the graph TensorFlow places and
    # optimizes stays small: a faster first step and step than inlined
    # (docs/benchmarks.md).
    fn = Unplaced if self._jit_compile else Body
    # Named by its order in the graph, not the process's traces before it:
    # XLA's compile cache then finds it again in the next process.
    fn.__name__ = internal_tf.StableFunctionName(
        re.sub(r'[^A-Za-z0-9_]', '_', self._name) +
        ('_xla' if self._jit_compile else ''))
    self._fn = tf2.function(fn,
                            autograph=False,
                            jit_compile=self._jit_compile or None,
                            experimental_attributes={'_noinline': True})
    self._fn.__name__ = self._name

  def _ExportWeightUses(self, first_op, theta_args, out, new_accs):
    """Routes each weight MatMul or lookup since `first_op` through a zero.

    Returns:
      (out, new_accs) with every such product or lookup replaced by it plus a
      zero input, and the operands to export (function outputs): the MatMuls'
      left operands, the lookups' ids.
    """
    fg = tf.get_default_graph()
    leaf_index = {t.ref(): k for k, t in enumerate(theta_args)}
    replaced = {}
    xs = []
    self._exported = []
    for op in fg.get_operations()[first_op:]:
      rows = op.type == 'GatherV2'
      if op.type == 'MatMul':
        skip = op.get_attr('transpose_a') or op.get_attr('transpose_b')
      elif (self._flat_weight_matmuls and
            gemm_rewrite.IsBroadcastWeightMatMul(op)):
        continue  # Rewritten (gemm_rewrite): no consumer left.
      elif op.type == 'BatchMatMulV2':
        # x [..., in] @ w [in, out], w broadcast over x's leading dimensions.
        skip = (op.get_attr('adj_x') or op.get_attr('adj_y') or
                op.inputs[1].shape.rank != 2)
      elif rows:
        # gather(w, ids) along w's first axis: a lookup of w's rows.
        skip = (op.get_attr('batch_dims') != 0 or
                tf.get_static_value(op.inputs[2]) != 0)
      else:
        continue
      if skip or not op.outputs[0].dtype.is_floating:
        continue
      w = matmul_grad.ThroughIdentities(op.inputs[0 if rows else 1],
                                        leaf_index)
      y = op.outputs[0]
      if w is None or not y.shape.is_fully_defined():
        continue
      uses = [(c, j) for c in y.consumers()
              for j, t in enumerate(c.inputs) if t.ref() == y.ref()]
      if rows:  # [ids, ...]: IndexedSlices' values.
        zero_shape = ([op.inputs[1].shape.num_elements()] +
                      w.shape[1:].as_list())
      else:  # [rows, out]: a BatchMatMul's rows flattened, so is dy.
        zero_shape = [y.shape.num_elements() // y.shape[-1], y.shape[-1]]
      # Created in the calling graph: a captured input of every call, so
      # not under the first call's name scope or control dependencies.
      with fg.outer_graph.as_default(), tf.control_dependencies(
          None), tf.name_scope(self._name + '_exported/'):
        zero = tf.zeros(zero_shape, y.dtype,
                        name='weight_lookup_dy' if rows else 'weight_matmul_dy')
      y_z = y + (zero if y.shape == zero.shape else tf.reshape(zero, y.shape))
      for c, j in uses:
        internal_tf.UpdateInput(c, j, y_z)
      replaced[y.ref()] = y_z
      self._exported.append((leaf_index[w.ref()], zero, rows))
      if rows:
        # No gradient to w through the lookup in the function: the engine
        # builds it from the exported ids and the zero's gradient.
        internal_tf.UpdateInput(op, 0, tf.stop_gradient(op.inputs[0]))
        xs.append(tf.reshape(op.inputs[1], [-1]))
      else:
        matmul_grad.MarkExported(op)
        x = op.inputs[0]
        x = x if x.shape.rank == 2 else tf.reshape(x, [-1, x.shape[-1]])
        # No gradient flows back through the export: the backward function
        # then has no zero to add to x's gradient.
        xs.append(tf.stop_gradient(x))
        bias = _ExportBias(y_z, leaf_index)
        if bias is not None:
          self._exported.append((bias, zero, BIAS))
    swap = lambda t: t if t is None else replaced.get(t.ref(), t)
    out = tf.nest.map_structure(swap, out)
    return out, [swap(t) for t in new_accs], xs

  def _Args(self, theta, inputs, step):
    """(the function's arguments, the cell's accumulator values)."""
    if self._fn is None:
      self._Trace(theta, inputs, step)
      if self._jit_compile:
        self._UncompiledIfUnmatched(*self._Args(theta, inputs, step))
    accs = nest_util.Flat(self._cell.GetAccumulatorValues())
    args = nest_util.Flat(theta) + [x for x in nest_util.Flat(inputs) if x is not None]
    args += [step]
    if self._has_global_step:
      if self._global_step is None:
        # Read once for all calls, where the variable lives; not under the
        # first call's name scope or control dependencies.
        with tf.control_dependencies(None), tf.name_scope(
            self._name + '_global_step/'):
          self._global_step = tf.convert_to_tensor(py_utils.GetGlobalStep())
      args.append(self._global_step)
    return args + accs, accs

  def _UncompiledIfUnmatched(self, args, accs):
    """Retraces uncompiled if XLA would draw some random op differently.

    So `jit_compile` changes a cell's speed only, never its random draws.
    """
    graph = self._fn.get_concrete_function(*args).graph
    if accs:  # The trace left the function's own tensors there.
      self._cell.SetAccumulatorValues(
          tf.nest.pack_sequence_as(self._acc_struct, accs))
    unmatched = jit_random.UnmatchedRandomOps(graph)
    if unmatched:
      tf.logging.info(
          '%s: built without XLA (jit_compile): XLA draws %s otherwise than '
          "TensorFlow's kernels.", self._name, ', '.join(unmatched))
      self._jit_compile = False
      self._Trace(*self._traced_args)

  def HasUnexportedLookups(self, theta, inputs, step) -> bool:
    """Whether the cell gathers from a weight in a way it does not export.

    Traces the function for these inputs (once; calls reuse the trace). A
    function returns such a weight's gradient dense, where inline cells keep
    it sparse (IndexedSlices), which the gradient sync and sharded tables
    rely on. A lookup along the weight's first axis is exported (its
    gradient built sparse outside); any other (another axis, batch_dims, a
    weight of unknown shape) is not.
    """
    if self._unexported_lookups is None:
      args, accs = self._Args(theta, inputs, step)
      graph = self._fn.get_concrete_function(*args).graph
      if accs:  # The trace left the function's own tensors there.
        self._cell.SetAccumulatorValues(
            tf.nest.pack_sequence_as(self._acc_struct, accs))
      leaves = {t.ref() for t in graph.inputs[:len(nest_util.Flat(theta))]}
      self._unexported_lookups = any(
          op.type in ('GatherV2', 'Gather', 'ResourceGather') and op.inputs and
          matmul_grad.ThroughIdentities(op.inputs[0], leaves) is not None
          for op in graph.get_operations())
    return self._unexported_lookups

  def __call__(self, theta, inputs, step):
    """The cell on one micro-batch; updates the cell's accumulators.

    Args:
      theta: The cell's theta (a NestedMap of tensors).
      inputs: The cell's inputs (a tuple; None entries allowed).
      step: The micro-batch step tensor (Lingvo's per-micro-batch step).

    Returns:
      The cell's outputs, in the structure its FProp returns.
    """
    args, accs = self._Args(theta, inputs, step)
    with internal_tf.CallsOptimizedOnce():
      results = self._fn(*args)
    results = list(results) if isinstance(results, (list, tuple)) else [
        results]
    n_xs = sum(rows != BIAS for _, _, rows in self._exported)
    if n_xs:
      xs = results[len(results) - n_xs:]
      results = results[:len(results) - n_xs]
      it = iter(xs)
      operands = [Exported(args[k], None if rows == BIAS else next(it), zero,
                           rows) for k, zero, rows in self._exported]
      calls = graph_state.Get(tf.get_default_graph(), _OPERANDS, dict)
      for t in results:
        calls[t.op.name] = operands
    n_out = len(results) - len(accs)
    if accs:
      self._cell.SetAccumulatorValues(
          tf.nest.pack_sequence_as(self._acc_struct, results[n_out:]))
    it = iter(results[:n_out])
    flat = [None if t is None else next(it) for t in nest_util.Flat(self._out_struct)]
    return tf.nest.pack_sequence_as(self._out_struct, flat)
