"""Weight matmuls of a 3-D activation as one 2-D GEMM, forward and backward.

Lingvo's FCLayer (the Transformer's feed-forward layers among others)
multiplies a [time, batch, in] activation by an [in, out] weight with
`tf.matmul`, which TensorFlow runs as a BatchMatMulV2 broadcasting the weight:
one [batch, in] x [in, out] product per time step, each repacking the whole
weight (on CPU, Eigen's small products run far below a GEMM's pace), and its
gradient as as many products again. The same product as
reshape -> MatMul -> reshape is one GEMM of time * batch rows; its gradients
are the MatMul's: the input's one GEMM, the weight's one GEMM of inner size
time * batch (which the engine further batches over micro-batches,
`matmul_grad.WeightGradientBatcher`). XLA folds the reshape itself; this
does it for TensorFlow's kernels.

`Flattened` rewrites the ops a cell's FProp built: each consumer of such a
BatchMatMul's output reads the reshaped MatMul's instead, so the BatchMatMul
is left without consumers and pruned when the graph runs. The MatMul is made
where the BatchMatMul was (its device, its name scope, the gradient overrides
in effect), so it takes the gradient a cell's MatMuls take.
"""

from typing import Dict

import lingvo.compat as tf

from lingvo_ext._internal import tf as internal_tf

_TYPES = ('BatchMatMulV2', 'BatchMatMulV3')


def IsBroadcastWeightMatMul(op) -> bool:
  """Whether `op` is x [..., in] @ w [in, out], w broadcast, no adjoints.

  Only those become a 2-D MatMul: any other batched product (attention's
  logits and context, two activations) is left as it is.
  """
  if op.type not in _TYPES:
    return False
  x, w = op.inputs
  if (w.shape.rank != 2 or x.shape.rank is None or x.shape.rank < 3 or
      op.get_attr('adj_x') or op.get_attr('adj_y')):
    return False
  if op.type == 'BatchMatMulV3':
    # A product that casts (Ta, Tb, Tout differ) has no MatMul of one dtype.
    return op.get_attr('Ta') == op.get_attr('Tb') == op.get_attr('Tout')
  return True


def _Rewrite(op):
  """The reshape -> MatMul -> reshape of a BatchMatMul; rewires consumers."""
  x, w = op.inputs
  y = op.outputs[0]
  scope = op.name.rpartition('/')[0]
  with tf.device(op.device), tf.name_scope(
      (scope + '/' if scope else '') + op.name.rpartition('/')[2] + '_2d/'):
    depth = w.shape[0] if w.shape[0] is not None else tf.shape(w)[0]
    flat = tf.matmul(tf.reshape(x, [-1, depth]), w)
    if y.shape.is_fully_defined():
      out_shape = y.shape.as_list()
    else:
      out_shape = tf.concat([tf.shape(x)[:-1], tf.shape(w)[1:]], axis=0)
    new_y = tf.reshape(flat, out_shape)
  new_y.set_shape(y.shape)
  for c in list(y.consumers()):
    for j, t in enumerate(c.inputs):
      if t.ref() == y.ref() and c is not new_y.op:
        internal_tf.UpdateInput(c, j, new_y)
  return new_y


def RewriteOps(ops) -> Dict:
  """Rewrites each broadcasting weight matmul among `ops` (already built).

  Returns:
    {the old output's ref: its replacement}, for the tensors a caller holds
    (a layer's returned outputs) that no op reads.
  """
  replaced = {}
  for op in list(ops):
    if IsBroadcastWeightMatMul(op):
      replaced[op.outputs[0].ref()] = _Rewrite(op)
  return replaced


def Flattened(fn, enabled: bool = True):
  """Calls `fn()` (builds ops in the default graph) and rewrites its ops.

  Args:
    fn: Builds a cell's FProp; returns a structure of tensors (None allowed).
    enabled: False calls `fn` only (a PipeliningLayer's
      `flat_weight_matmuls`).

  Returns:
    `fn()`'s result, any rewritten output replaced by the new one.
  """
  if not enabled:
    return fn()
  graph = tf.get_default_graph()
  first = len(graph.get_operations())
  out = fn()
  replaced = RewriteOps(graph.get_operations()[first:])
  if not replaced:
    return out
  return Swap(out, replaced)


def Swap(structure, replaced):
  """`structure` with each tensor in `replaced` (refs) swapped for its new."""
  def One(t):
    if isinstance(t, tf.Tensor):
      return replaced.get(t.ref(), t)
    return t
  return tf.nest.map_structure(One, structure)
