"""A layer XLA cannot compile: its input copied through numpy (PyFunc)."""

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
import numpy as np


class HostCopy(base_layer.BaseLayer):
  """x, copied through numpy."""

  def FProp(self, theta, x):
    y = tf.numpy_function(np.copy, [x], x.dtype)
    y.set_shape(x.shape)
    return y

  @classmethod
  def FPropMeta(cls, p, x):
    return py_utils.NestedMap(flops=0, out_shapes=(x,))


# The source of a module registering HostCopyTiny: a classifier whose first
# pipeline cell is HostCopy, an op (PyFunc) XLA cannot compile.
EXPERIMENT = '''
from lingvo import model_registry

from params import image
from lingvo_ext.tasks.image import model
from tests.support.host_copy import HostCopy


class HostCopyClassifier(model.ConvClassifier):

  @classmethod
  def LayerStack(cls, task_params):
    stack, shapes = super().LayerStack(task_params)
    return [HostCopy.Params().Set(name='host_copy')] + stack, shapes


@model_registry.RegisterSingleTaskModel
class HostCopyTiny(image.ConvClassifierTiny):
  MAX_STEPS = 3

  def _TaskParams(self):
    p = super()._TaskParams()
    p.cls = HostCopyClassifier
    return p
'''
