"""lingvo_ext/layers/: the layer library the tasks are built from, with
accurate FPropMeta.

Every layer here can be a sub-layer of a GPipe `FeatureExtractionLayer`:
`FProp(theta, x)` returns one tensor, and the classmethod
`FPropMeta(p, *shapes)` takes `tshape.Shape`s and returns
`NestedMap(flops=..., out_shapes=(tshape.Shape,))`.

FLOPs are forward FLOPs with a multiply-add counted as 2, the same count
TensorFlow's profiler gives for the layer's FProp graph. The layers are
written with ops the profiler has FLOP statistics for where there is a
choice (e.g. a causal mask is an Add of a bias, not a Select); the few ops it
has none for (Relu, Tanh, Max) are named in flops.py and in the FPropMeta
that counts them. Gathers, reshapes, transposes, slices and casts cost 0.

No layer keeps batch statistics: a micro-batched pipeline run must equal the
sequential run exactly.

This is the module to import them from; each kind lives in a module of its
own: `dense_layers.py` (FCLayer, LayerNormLayer), `transformer_layer.py`,
`vocab_layers.py` (EmbeddingLayer, SoftmaxLayer), `conv_layers.py` (Conv2D,
pooling, flatten), `sharding.py` (a layer's variables sharded across
devices), `flops.py` (the FLOP formulas) and `layer_util.py` (what they
share). The pipeline (lingvo_ext/pipeline/) and its layer
(lingvo_ext/core/gpipe.py) sit above this folder; it imports neither.
"""

from lingvo_ext.layers import conv_layers
from lingvo_ext.layers import dense_layers
from lingvo_ext.layers import layer_util
from lingvo_ext.layers import transformer_layer
from lingvo_ext.layers import vocab_layers

ACTIVATIONS = layer_util.ACTIVATIONS
Activate = layer_util.Activate

FCLayer = dense_layers.FCLayer
LayerNormLayer = dense_layers.LayerNormLayer

TransformerLayer = transformer_layer.TransformerLayer

POSITION_EMBEDDINGS = vocab_layers.POSITION_EMBEDDINGS
SinusoidalPositionTable = vocab_layers.SinusoidalPositionTable
EmbeddingLayer = vocab_layers.EmbeddingLayer
SoftmaxLayer = vocab_layers.SoftmaxLayer

POOLING_TYPES = conv_layers.POOLING_TYPES
PADDINGS = conv_layers.PADDINGS
Conv2DLayer = conv_layers.Conv2DLayer
PoolingLayer = conv_layers.PoolingLayer
GlobalPoolingLayer = conv_layers.GlobalPoolingLayer
FlattenLayer = conv_layers.FlattenLayer
