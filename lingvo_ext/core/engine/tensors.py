"""Small helpers on the engine's tensors and structures."""

from typing import List

import lingvo.compat as tf


def ToTuple(x):
  if isinstance(x, list):
    return tuple(x)
  return x if isinstance(x, tuple) else (x,)



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


def Flat(structure) -> List:
  return tf.nest.flatten(structure)


def IsFloat(t) -> bool:
  return t is not None and t.dtype.is_floating


def Group(tensors):
  tensors = [t for t in tensors if t is not None]
  return tf.group(*tensors) if tensors else None

