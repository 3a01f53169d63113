"""MatMul gradients for pipeline cells: fast CPU dx, batched weight gradients.

With oneDNN off (TensorFlow's default on CPUs without AVX512-VNNI/AMX, or
TF_ENABLE_ONEDNN_OPTS=0), TensorFlow's Eigen MatMul repacks a
transposed right-hand side on every call. The input gradient of y = x @ W is
grad @ W^T, so each call pays a fixed cost in the size of W, several times
the untransposed product's, which dominates small micro-batches.
(W @ grad^T)^T transposes only the small operands instead, is bit-identical
and costs about the untransposed product. Folding an
explicit tf.transpose(W) does not help: Grappler turns it back into
transpose_b. oneDNN's MatMul has no such cost, so with oneDNN on the plain
gradient is used (`TransposedInputGradPays`).
"""

import contextlib
import functools
import threading

import lingvo.compat as tf

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.pipeline import graph_state


@functools.lru_cache(maxsize=None)
def TransposedInputGradPays() -> bool:
  """Whether (W dy^T)^T beats dy W^T on CPU: only with Eigen's kernels."""
  return not internal_tf.IsMklEnabled()


def IsCpuDevice(device: str) -> bool:
  """Whether ops placed on `device` run on a CPU (an empty device does)."""
  return not any(kind in device.upper() for kind in ('GPU', 'TPU'))


# --- Weight gradients batched across micro-batches ----------------------------

PIPELINE_GRADIENT_NAME = 'LingvoExtPipelineMatMul'
# `rows` of a use that adds a bias to a weight MatMul's product: no operand,
# the gradient is dy summed over its rows.
BIAS = 'bias'
CELL_BATCH_MATMUL_GRADIENT_NAME = 'LingvoExtCellBatchMatMul'
# The batchers being built into, innermost last: a graph-building hook on a
# thread-local stack (as stacking.py's), so graphs built on two threads do not
# see each other's.
_LOCAL = threading.local()


def _Batchers():
  if not hasattr(_LOCAL, 'batchers'):
    _LOCAL.batchers = []
  return _LOCAL.batchers


def ThroughIdentities(t, refs):
  """The tensor in `refs` (tensor refs) that `t` is through Identities, or None.

  Layers read each weight through an Identity per call.
  """
  while t.ref() not in refs and t.op.type == 'Identity':
    t = t.op.inputs[0]
  return t if t.ref() in refs else None


class WeightGradientBatcher:
  """Computes a weight's x^T dy once over several micro-batches.

  The collector of one cell's micro-batch for its owner,
  engine/weight_gradients.py's `CellWeightGradients` (which says why an
  inline cell's MatMuls reach it through a thread-local stack).

  Inside `with batcher:`, the gradient of a MatMul made under
  `PipelineMatMulGradients` whose right operand is one of `weights` (or an
  Identity of one) returns
  no weight gradient; it records (x, dy) instead. `Gradients` then computes
  each weight's gradient as one MatMul of the concatenated rows: a single
  weight-sized result rather than one per micro-batch summed at the end,
  whose writes and reads dominate at small micro-batches. A MatMul of two
  activations is differentiated as usual, so gradients to activations are
  never held back.
  """

  def __init__(self, weights):
    self._weights = {w.ref() for w in weights}
    # (weight ref, rows) -> ([operand], [dy]): MatMuls' left operands, or
    # with `rows` lookups' ids.
    self._groups = {}

  def __enter__(self):
    _Batchers().append(self)
    return self

  def __exit__(self, *unused_exc):
    _Batchers().pop()

  def Collects(self, b) -> bool:
    return ThroughIdentities(b, self._weights) is not None

  def AddOperands(self, weight, operand, dy, rows=False):
    """Records a use of `weight` (one of `weights`) from exported operands.

    Args:
      weight: The weight.
      operand: A MatMul's left operand x [rows, in] (gradient x^T dy); with
        `rows`, a lookup's row ids as a vector (gradient: dy's rows); None
        for a bias (`rows` BIAS).
      dy: The use's output gradient, [rows, out] or [ids, ...].
      rows: Whether the use is a lookup of the weight's rows, or BIAS: a
        bias added to a product (gradient: dy summed over its rows).
    """
    operands, dys = self._groups.setdefault((weight.ref(), rows), ([], []))
    operands.append(operand)
    dys.append(dy)

  def Add(self, b, a, dy):
    # Identity's gradient is the identity: x^T dy belongs to the weight.
    self.AddOperands(ThroughIdentities(b, self._weights), a, dy)

  @classmethod
  def Merged(cls, weights, batchers):
    """One batcher of `weights` holding what `batchers` recorded, in order.

    Its `Gradients` are one MatMul per weight over all their micro-batches'
    rows (a run of 'W' actions computed at once).
    """
    merged = cls(weights)
    for b in batchers:
      for key, (operands, dys) in b._groups.items():  # pylint: disable=protected-access
        group = merged._groups.setdefault(key, ([], []))  # pylint: disable=protected-access
        group[0].extend(operands)
        group[1].extend(dys)
    return merged

  def Gradients(self, weights):
    """The batched gradients of `weights` (None where nothing was recorded).

    A weight only looked up gets IndexedSlices of the group's rows.
    """
    out = []
    concats = {}  # A bias's dys are its product's: concatenated once.
    for w in weights:
      parts = []
      group = self._groups.get((w.ref(), False))
      if group is not None:
        parts.append(tf.matmul(_Concat(group[0], concats),
                               _Concat(group[1], concats), transpose_a=True))
      group = self._groups.get((w.ref(), True))
      if group is not None:  # As inline: sparse, the rows looked up.
        parts.append(tf.IndexedSlices(_Concat(group[1], concats),
                                      _Concat(group[0], concats), tf.shape(w)))
      group = self._groups.get((w.ref(), BIAS))
      if group is not None:
        parts.append(BiasGradient(_Concat(group[1], concats)))
      out.append(SumGradients(parts))
    return out


def BiasGradient(dy):
  """dy [rows, out] summed over its rows, [out]: as a [1, rows] x [rows,
  out] GEMM, which TensorFlow's CPU GEMMs (oneDNN's and Eigen's) run faster
  than its Sum over the outer axis (bench/weight_grad_concat.py --bias)."""
  rows, cols = (n if n is not None else tf.shape(dy)[k]
                for k, n in enumerate(dy.shape.as_list()))
  return tf.reshape(tf.matmul(tf.ones([1, rows], dy.dtype), dy), [cols])


def _Concat(tensors, cache):
  key = tuple(t.ref() for t in tensors)
  if key not in cache:
    cache[key] = (tensors[0] if len(tensors) == 1 else
                  tf.concat(tensors, axis=0))
  return cache[key]


def SumGradients(parts):
  """The sum of gradients, None entries skipped (None if all are).

  Sparse parts (IndexedSlices) stay sparse when all are, their rows
  concatenated as tf.gradients' own aggregation keeps them; a sum with a
  dense part is dense.
  """
  parts = [g for g in parts if g is not None]
  if len(parts) <= 1:
    return parts[0] if parts else None
  sparse = [g for g in parts if isinstance(g, tf.IndexedSlices)]
  if len(sparse) == len(parts):
    return tf.IndexedSlices(
        tf.concat([g.values for g in parts], axis=0),
        tf.concat([g.indices for g in parts], axis=0), parts[0].dense_shape)
  return tf.add_n([tf.convert_to_tensor(g) for g in parts])


# Graph state (graph_state): names of MatMuls whose weight gradient is
# computed outside their graph, from operands it exports (`MarkExported`).
_EXPORTED = 'matmul_grad_exported'


def MarkExported(op) -> None:
  """`op`'s weight gradient is left to whoever holds its exported operands.

  A cell function (cell_function.py) returns a weight MatMul's left operand
  and takes a zero it adds to the MatMul's output, whose gradient is the
  MatMul's output gradient; the weight gradient x^T dy is then batched
  across micro-batches outside the function, so its backward function
  computes none.
  """
  graph_state.Get(op.graph, _EXPORTED, set).add(op.name)


def _IsExported(op) -> bool:
  return op.name in graph_state.Peek(op.graph, _EXPORTED, ())


@tf.RegisterGradient(PIPELINE_GRADIENT_NAME)
def _PipelineMatMulGrad(op, grad):
  """MatMul's gradient for pipeline cells: CPU dx, batched weight gradient."""
  if (op.get_attr('transpose_a') or op.get_attr('transpose_b') or
      op.inputs[0].dtype.is_complex):
    return internal_tf.MatMulGrad(op, grad)
  a, b = op.inputs
  skip = getattr(op, 'skip_input_indices', None) or ()
  grad_a = None
  if 0 not in skip:
    if IsCpuDevice(op.device) and TransposedInputGradPays():
      grad_a = tf.transpose(tf.matmul(b, grad, transpose_b=True))
    else:
      grad_a = tf.matmul(grad, b, transpose_b=True)
  grad_b = None
  if 1 not in skip and not _IsExported(op):
    batchers = _Batchers()
    if batchers and batchers[-1].Collects(b):
      batchers[-1].Add(b, a, grad)
    else:
      grad_b = tf.matmul(a, grad, transpose_a=True)
  return grad_a, grad_b


@tf.RegisterGradient(CELL_BATCH_MATMUL_GRADIENT_NAME)
def _CellBatchMatMulGrad(op, grad):
  """BatchMatMulV2's gradient in a cell function: no exported weight's."""
  if not _IsExported(op):
    return internal_tf.BatchMatMulV2Grad(op, grad)
  # x @ w, w a [in, out] weight broadcast over x's leading dimensions, no
  # adjoints (see cell_function.py): x's gradient only.
  return tf.matmul(grad, op.inputs[1], adjoint_b=True), None


@contextlib.contextmanager
def CellMatMulGradients():
  """MatMuls and BatchMatMuls made inside: gradients for cell functions.

  A MatMul's as `PipelineMatMulGradients`'; a BatchMatMulV2's as
  TensorFlow's, except that neither computes the gradient of a weight whose
  operands the cell function exports (`MarkExported`).
  """
  with tf.get_default_graph().gradient_override_map({
      'MatMul': PIPELINE_GRADIENT_NAME,
      'BatchMatMulV2': CELL_BATCH_MATMUL_GRADIENT_NAME}):
    yield


@contextlib.contextmanager
def PipelineMatMulGradients(device: str = ''):
  """MatMuls made inside use _PipelineMatMulGrad (any device)."""
  del device  # The gradient looks at the op's own device.
  with tf.get_default_graph().gradient_override_map(
      {'MatMul': PIPELINE_GRADIENT_NAME}):
    yield
