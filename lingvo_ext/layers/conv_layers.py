"""Image layers: convolution, pooling and flattening, with accurate FPropMeta.

The conventions of every layer here are in `lingvo_ext.layers`.
"""

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_ext.layers import flops
from lingvo_ext.layers import layer_util

POOLING_TYPES = ('MAX', 'AVG')
PADDINGS = ('SAME', 'VALID')


class Conv2DLayer(base_layer.BaseLayer):
  """2D convolution on NHWC inputs, with bias and activation."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('filter_shape', (0, 0, 0, 0),
             'Filter shape [height, width, in_channels, out_channels].')
    p.Define('filter_stride', (1, 1), 'Strides [height, width].')
    p.Define('padding', 'SAME', 'SAME or VALID.')
    p.Define('activation', 'NONE',
             'Activation after the conv: NONE, RELU, TANH or GELU.')
    p.Define('has_bias', True, 'Whether to add a learned bias.')
    return p

  @classmethod
  def _CheckParams(cls, p):
    layer_util.CheckPositiveInts(p, 'filter_shape', 4, ' [h, w, in, out]')
    layer_util.CheckPositiveInts(p, 'filter_stride', 2)
    layer_util.CheckChoice(p, 'padding', PADDINGS)
    layer_util.CheckChoice(p, 'activation', layer_util.ACTIVATIONS)

  def __init__(self, params):
    super().__init__(params)
    self._CheckParams(self.params)

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    layer_util.CreateWeight(self, 'w', list(p.filter_shape))
    if p.has_bias:
      layer_util.CreateWeight(self, 'b', [p.filter_shape[-1]],
                    py_utils.WeightInit.Constant(0.0))

  def FProp(self, theta, inputs):
    """Convolves inputs [B, H, W, in] into [B, H', W', out]."""
    p = self.params
    sh, sw = p.filter_stride
    x = tf.nn.conv2d(inputs, theta.w, strides=[1, sh, sw, 1], padding=p.padding)
    if p.has_bias:
      x = tf.nn.bias_add(x, theta.b)
    return layer_util.Activate(x, p.activation)

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    cls._CheckParams(p)
    layer_util.CheckRank(p, inputs, 4, 'NHWC inputs')
    fh, fw, ic, oc = p.filter_shape
    layer_util.CheckLastDim(p, inputs, ic, 'filter_shape[2]')
    b, h, w, _ = inputs
    sh, sw = p.filter_stride
    oh = flops.Conv2DOutputSize(h, fh, sh, p.padding)
    ow = flops.Conv2DOutputSize(w, fw, sw, p.padding)
    out = tshape.Shape([b, oh, ow, oc])
    n = out.num_elements()
    num_flops = flops.Conv2DFlops(b, oh, ow, fh, fw, ic, oc)
    if p.has_bias:
      num_flops += n
    num_flops += flops.ActivationFlops(p.activation, n)
    return layer_util.Meta(num_flops, out)

  # FLOPs FPropMeta counts that TF's profiler does not: the activation's.
  UnprofiledFlops = layer_util.UnprofiledActivation(
      lambda cls, p, x: cls.FPropMeta(p, x).out_shapes[0].num_elements())


class PoolingLayer(base_layer.BaseLayer):
  """Max or average pooling on NHWC inputs."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('window', (2, 2), 'Pooling window [height, width].')
    p.Define('stride', (2, 2), 'Strides [height, width].')
    p.Define('pooling_type', 'MAX', 'MAX or AVG.')
    p.Define('padding', 'SAME', 'SAME or VALID.')
    return p

  @classmethod
  def _CheckParams(cls, p):
    for name in ('window', 'stride'):
      layer_util.CheckPositiveInts(p, name, 2)
    layer_util.CheckChoice(p, 'pooling_type', POOLING_TYPES)
    layer_util.CheckChoice(p, 'padding', PADDINGS)

  def __init__(self, params):
    super().__init__(params)
    self._CheckParams(self.params)

  def FProp(self, theta, inputs):
    """Pools inputs [B, H, W, C] into [B, H', W', C]."""
    del theta
    p = self.params
    pool = tf.nn.max_pool2d if p.pooling_type == 'MAX' else tf.nn.avg_pool2d
    return pool(
        inputs,
        ksize=[1] + list(p.window) + [1],
        strides=[1] + list(p.stride) + [1],
        padding=p.padding)

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    cls._CheckParams(p)
    layer_util.CheckRank(p, inputs, 4, 'NHWC inputs')
    b, h, w, c = inputs
    oh = flops.Conv2DOutputSize(h, p.window[0], p.stride[0], p.padding)
    ow = flops.Conv2DOutputSize(w, p.window[1], p.stride[1], p.padding)
    out = tshape.Shape([b, oh, ow, c])
    num_flops = flops.PoolFlops(out.num_elements(), *p.window)
    return layer_util.Meta(num_flops, out)


class GlobalPoolingLayer(base_layer.BaseLayer):
  """Pools [B, H, W, C] over H and W into [B, C]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('pooling_type', 'AVG', 'AVG or MAX.')
    return p

  def __init__(self, params):
    super().__init__(params)
    layer_util.CheckChoice(self.params, 'pooling_type', POOLING_TYPES)

  def FProp(self, theta, inputs):
    """Pools inputs [B, H, W, C] into [B, C]."""
    del theta
    if self.params.pooling_type == 'AVG':
      return tf.reduce_mean(inputs, axis=[1, 2])
    return tf.reduce_max(inputs, axis=[1, 2])

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    layer_util.CheckRank(p, inputs, 4, 'NHWC inputs')
    # One add (AVG; the divide per output is folded into Mean's count) or one
    # compare (MAX) per input element.
    num_flops = inputs.num_elements()
    out = tshape.Shape([inputs[0], inputs[3]])
    return layer_util.Meta(num_flops, out)

  @classmethod
  def UnprofiledFlops(cls, p, inputs):
    """TF's profiler has no FLOP statistics for Max (the MAX reduction)."""
    if p.pooling_type == 'MAX':
      return flops.ToInt(inputs.num_elements())
    return 0


class FlattenLayer(base_layer.BaseLayer):
  """Reshapes [B, d1, d2, ...] into [B, d1*d2*...]; 0 FLOPs."""

  def FProp(self, theta, inputs):
    """Flattens all but the first dim of inputs."""
    del theta
    shape = layer_util.Shape(inputs)
    return tf.reshape(inputs, [shape[0], -1])

  @classmethod
  def FPropMeta(cls, p, inputs):
    py_utils.CheckShapes((inputs,))
    rest = 1
    for d in inputs[1:]:
      rest *= d
    out = tshape.Shape([inputs[0], rest])
    return layer_util.Meta(0, out)
