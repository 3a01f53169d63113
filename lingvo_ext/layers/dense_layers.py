"""Dense layers: FCLayer and LayerNormLayer, with accurate FPropMeta.

The conventions of every layer here are in `lingvo_ext.layers`.
"""


import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_ext.layers import flops
from lingvo_ext.layers import layer_util


class FCLayer(base_layer.BaseLayer):
  """Fully connected layer: activation(x * w + b) on [..., input_dim]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input (its last dim).')
    p.Define('output_dim', 0, 'Depth of the output.')
    p.Define('activation', 'NONE',
             'Activation after the projection: NONE, RELU, TANH or GELU.')
    p.Define('has_bias', True, 'Whether to add a learned bias.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    layer_util.CheckPositive(p, 'input_dim', 'output_dim')
    layer_util.CheckChoice(p, 'activation', layer_util.ACTIVATIONS)

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    layer_util.CreateWeight(self, 'w', [p.input_dim, p.output_dim])
    if p.has_bias:
      layer_util.CreateWeight(self, 'b', [p.output_dim],
                    py_utils.WeightInit.Constant(0.0))

  def FProp(self, theta, inputs):
    """Projects inputs [..., input_dim] to [..., output_dim]."""
    p = self.params
    shape = layer_util.Shape(inputs)
    x = inputs if len(shape) == 2 else tf.reshape(inputs, [-1, p.input_dim])
    x = tf.matmul(x, theta.w)
    if p.has_bias:
      x = tf.nn.bias_add(x, theta.b)
    x = layer_util.Activate(x, p.activation)
    if len(shape) != 2:
      x = tf.reshape(x, shape[:-1] + [p.output_dim])
    return x

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    layer_util.CheckLastDim(p, inputs, p.input_dim, 'input_dim')
    rows = inputs.num_elements() // p.input_dim
    num_flops = flops.FCFlops(rows, p.input_dim, p.output_dim, p.activation,
                              p.has_bias)
    out = tshape.Shape(inputs[:-1] + [p.output_dim])
    return layer_util.Meta(num_flops, out)

  # FLOPs FPropMeta counts that TF's profiler does not: the activation's.
  UnprofiledFlops = layer_util.UnprofiledActivation(
      lambda cls, p, x: x.num_elements() // p.input_dim * p.output_dim)


class LayerNormLayer(base_layer.BaseLayer):
  """Layer normalization over the last dim, with scale and bias.

  Written out in profiled ops (Mean, SquaredDifference, Rsqrt...) rather than
  a fused kernel, so that its FLOPs are visible to TF's profiler.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input (its last dim).')
    p.Define('epsilon', 1e-6, 'Added to the variance before rsqrt.')
    return p

  def __init__(self, params):
    super().__init__(params)
    layer_util.CheckPositive(self.params, 'input_dim')

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    layer_util.CreateWeight(self, 'scale', [p.input_dim],
                  py_utils.WeightInit.Constant(1.0))
    layer_util.CreateWeight(self, 'bias', [p.input_dim],
                  py_utils.WeightInit.Constant(0.0))

  def FProp(self, theta, inputs):
    """Normalizes inputs [..., input_dim]."""
    p = self.params
    mean = tf.reduce_mean(inputs, axis=-1, keepdims=True)
    variance = tf.reduce_mean(
        tf.math.squared_difference(inputs, mean), axis=-1, keepdims=True)
    x = (inputs - mean) * tf.math.rsqrt(variance + p.epsilon)
    return x * theta.scale + theta.bias

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    layer_util.CheckLastDim(p, inputs, p.input_dim, 'input_dim')
    num_flops = flops.LayerNormFlops(inputs.num_elements(), p.input_dim)
    return layer_util.Meta(num_flops, inputs)
