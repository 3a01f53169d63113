"""Small helpers on the engine's tensors and structures."""

from typing import List

import lingvo.compat as tf
from lingvo.core import py_utils


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


def Checked(tensors, message: str) -> List:
  """`tensors` through Lingvo's numeric check (`py_utils.CheckNumerics`, off
  under --enable_check_numerics=false); None entries kept, IndexedSlices'
  values checked."""
  out = []
  for t in tensors:
    if isinstance(t, tf.IndexedSlices):
      t = tf.IndexedSlices(py_utils.CheckNumerics(t.values, message),
                           t.indices, t.dense_shape)
    elif t is not None:
      t = py_utils.CheckNumerics(t, message)
    out.append(t)
  return out


def IsFloat(t) -> bool:
  return t is not None and t.dtype.is_floating


def Group(tensors):
  tensors = [t for t in tensors if t is not None]
  return tf.group(*tensors) if tensors else None



def SplitGrads(flat_out, out_grads, num_micro: int, batch_dim: int):
  """Per micro-batch, the flat gradients of `flat_out` (None entries: no
  output, or no gradient) from `out_grads`, those of its present entries."""
  it = iter(out_grads)
  dys_flat = []
  for o in flat_out:
    g = None if o is None else next(it)
    dys_flat.append(None if g is None else
                    tf.split(g, num_micro, axis=batch_dim))
  return [[None if d is None else d[t] for d in dys_flat]
          for t in range(num_micro)]


def ConcatGrads(flat_in, pieces, dx, batch_dim: int) -> List:
  """The gradients of the present `flat_in` from each micro-batch's `dx`
  (zeros for a micro-batch without one; `pieces` are the inputs' splits)."""
  in_grads = []
  for k, x in enumerate(flat_in):
    if x is None:
      continue
    parts = [d[k] for d in dx]
    if all(g is None for g in parts):
      in_grads.append(None)
      continue
    parts = [tf.zeros_like(pieces[k][t]) if g is None else g
             for t, g in enumerate(parts)]
    in_grads.append(tf.concat(parts, axis=batch_dim))
  return in_grads
