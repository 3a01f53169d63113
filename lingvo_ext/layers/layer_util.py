"""What the layers of lingvo_ext.core share: param checks, FPropMeta's result,
activations and weight creation.
"""

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np

from lingvo_ext.layers import flops

ACTIVATIONS = ('NONE', 'RELU', 'TANH', 'GELU')


def CheckChoice(p, name, choices):
  value = p.Get(name)
  if value not in choices:
    raise ValueError('%s.%s=%r is not supported; set it to one of %s.' %
                     (p.cls.__name__, name, value, ', '.join(choices)))


def CheckPositive(p, *names):
  for name in names:
    value = p.Get(name)
    if not isinstance(value, (int, np.integer)) or value <= 0:
      raise ValueError('%s.%s=%r must be a positive int; set it.' %
                       (p.cls.__name__, name, value))


def CheckPositiveInts(p, name, count, what=''):
  """Param `name` must be `count` positive ints (what: e.g. ' [h, w]')."""
  value = p.Get(name)
  if (len(value) != count or
      not all(isinstance(d, (int, np.integer)) and d > 0 for d in value)):
    raise ValueError('%s.%s=%r must be %d positive ints%s.' %
                     (p.cls.__name__, name, value, count, what))


def CheckRank(p, shape, rank, what):
  if shape.rank != rank:
    raise ValueError('%s (%s) expects %s of rank %d, got shape %s.' %
                     (p.cls.__name__, p.name, what, rank, shape))


def CheckLastDim(p, shape, dim, param_name):
  if shape.rank < 1 or shape[-1] != dim:
    raise ValueError(
        '%s (%s): input shape %s does not end in %s=%s; set %s to the '
        'input depth.' % (p.cls.__name__, p.name, shape, param_name, dim,
                          param_name))


def Meta(num_flops, out, **extra) -> py_utils.NestedMap:
  """FPropMeta's result: FLOPs (an int where known), out_shapes=(out,)."""
  return py_utils.NestedMap(flops=flops.ToInt(num_flops), out_shapes=(out,),
                            **extra)


def UnprofiledActivation(activated):
  """An UnprofiledFlops(p, inputs) classmethod: p.activation's FLOPs that TF's
  profiler does not count, over activated(cls, p, inputs) elements."""
  return classmethod(lambda cls, p, inputs: flops.ToInt(
      flops.ActivationUnprofiledFlops(p.activation, activated(cls, p, inputs))))


def Activate(x, activation):
  """Applies activation ('NONE', 'RELU', 'TANH', 'GELU') to x."""
  if activation == 'NONE':
    return x
  if activation == 'RELU':
    return tf.nn.relu(x)
  if activation == 'TANH':
    return tf.tanh(x)
  if activation == 'GELU':
    # The tanh form: 7 profiled ops and a Tanh (see flops.ACTIVATION_FLOPS).
    return tf.nn.gelu(x, approximate=True)
  raise ValueError('activation=%r is not supported; choose one of %s.' %
                   (activation, ', '.join(ACTIVATIONS)))


def CreateWeight(layer, name, shape, init=None):
  """layer's variable `name` of `shape`, in its dtype; init: params_init."""
  p = layer.params
  layer.CreateVariable(name, py_utils.WeightParams(
      shape=shape, init=init or p.params_init, dtype=p.dtype))


def Shape(x):
  """Static dims where known, else dynamic ones."""
  return py_utils.GetShape(x)
