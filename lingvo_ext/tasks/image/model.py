"""A GPipe-pipelined convolutional image classifier with uneven cells.

Its decoder (--job=decoder_dev) scores the whole dev split and writes the
confusion matrix and per-class accuracy to <logdir>/decoder_dev/
confusion-<step>.txt and to TensorBoard (confusion/class_<i>, and the matrix
as text).

The stack is a stem conv, blocks of convs of growing width (each block after
the first starts with a 2x2 max-pool), a flatten (or global pool) and a
softmax head. Its layers cost very different FLOPs, which is what
`PartitionSequentialLayers` balances when it cuts the stack into
num_partitions cells for the `PipeliningLayer`.

Its inference subgraph (`Inference()`, Lingvo's form; docs/serving.md):
`default` gives class probabilities and the top class of given images.
"""

import lingvo.compat as tf
from lingvo.core import metrics as metrics_lib
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_ext import layers
from lingvo_ext.tasks import decoding
from lingvo_ext.tasks import pipelined_task


class ConvClassifier(pipelined_task.PipelinedTask):
  """Pipelined CNN classifier reporting accuracy."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_classes', 10, 'Number of classes.')
    p.Define('stem_channels', 16, 'Output channels of the 3x3 stem conv.')
    p.Define(
        'block_channels', [32, 64], 'Output channels of each block; block '
        'i > 0 first halves the resolution with a 2x2 max-pool.')
    p.Define('convs_per_block', 1, 'Number of 3x3 convs in each block.')
    p.Define(
        'head_pooling', 'FLATTEN', 'How the head sees the last block: '
        'FLATTEN (all positions; learns fastest on small images), AVG or MAX '
        '(global pooling; any image size).')
    tp = p.train
    tp.learning_rate = 3e-3
    return p

  @classmethod
  def LayerStack(cls, task_params):
    """See PipelinedTask.LayerStack; the input shape is [batch_size, H, W, C]."""
    p = task_params
    cls._CheckHasInput(p)
    if not p.block_channels:
      raise ValueError(f'{p.name}: block_channels is empty; give at least '
                       'one block width.')
    h, w, c = p.input.data_shape
    stack = [
        layers.Conv2DLayer.Params().Set(
            name='stem',
            filter_shape=(3, 3, c, p.stem_channels),
            activation='RELU')
    ]
    depth = p.stem_channels
    for b, width in enumerate(p.block_channels):
      if b > 0:
        stack.append(layers.PoolingLayer.Params().Set(
            name='block%d_pool' % b, window=(2, 2), stride=(2, 2)))
      for j in range(p.convs_per_block):
        stack.append(layers.Conv2DLayer.Params().Set(
            name='block%d_conv%d' % (b, j),
            filter_shape=(3, 3, depth, width),
            activation='RELU'))
        depth = width
    if p.head_pooling == 'FLATTEN':
      stack.append(layers.FlattenLayer.Params().Set(name='flatten'))
    elif p.head_pooling in ('AVG', 'MAX'):
      stack.append(layers.GlobalPoolingLayer.Params().Set(
          name='global_pool', pooling_type=p.head_pooling))
    else:
      raise ValueError(f'{p.name}: head_pooling={p.head_pooling!r}; set it '
                       'to FLATTEN, AVG or MAX.')
    shapes = (tshape.Shape([p.input.batch_size, h, w, c]),)
    feature = shapes
    for l in stack:
      feature = l.cls.FPropMeta(l, *feature).out_shapes
    stack.append(layers.SoftmaxLayer.Params().Set(
        name='head', input_dim=int(feature[0][-1]), num_classes=p.num_classes))
    return stack, shapes

  def __init__(self, params):
    p = params
    if p.input is not None and p.input.num_classes != p.num_classes:
      raise ValueError(
          f'The input\'s num_classes={p.input.num_classes} differs from the '
          f'task\'s num_classes={p.num_classes}; set both to the same value.')
    super().__init__(params)

  def _PipelineParams(self):
    # The micro-batch steps (dropout seeds) stay float32 when the images
    # enter in bfloat16 (fprop_dtype): exact, not rounded past 256.
    return super()._PipelineParams().Set(state_dtype=tf.float32)

  def ComputePredictions(self, theta, input_batch):
    # The images in the dtype the layers compute in (fprop_dtype); the
    # logits back in float32 for the loss and the metrics.
    data = tf.cast(input_batch.data, py_utils.FPropDtype(self.params))
    logits = self.pipeline.FProp(theta.pipeline, data)
    return py_utils.NestedMap(logits=tf.cast(logits, tf.float32))

  def ComputeLoss(self, theta, predictions, input_batch):
    labels = input_batch.label
    weights = input_batch.weight
    logits = predictions.logits
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    num = tf.reduce_sum(weights)
    denom = tf.maximum(num, 1.0)
    loss = tf.reduce_sum(xent * weights) / denom
    correct = tf.cast(
        tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels),
        tf.float32)
    accuracy = tf.reduce_sum(correct * weights) / denom
    metrics = {
        # Weighted by real examples, so padding never counts.
        'loss': (loss, num),
        'log_pplx': (loss, num),
        'accuracy': (accuracy, num),
        'error': (1.0 - accuracy, num),
    }
    return metrics, {
        'loss': xent,
        'correct': correct,
        'example_ids': input_batch.example_ids
    }

  # --- Inference subgraphs (Lingvo's Inference(); lingvo_ext.serving).

  def Inference(self):
    """{'default': (fetches, feeds)}.

    default: feeds images (float32 [batch, H, W, C], as the input's data);
    fetches probs (float32 [batch, num_classes]), top_class (int32 [batch])
    and logits.
    """
    h, w, c = self.params.input.data_shape
    with tf.name_scope('inference'):
      images = tf.placeholder(tf.float32, [None, h, w, c], name='images')
      logits = self.ComputePredictions(
          self.theta, py_utils.NestedMap(data=images)).logits
      fetches = py_utils.NestedMap(
          probs=tf.nn.softmax(logits, name='probs'),
          top_class=tf.argmax(logits, -1, output_type=tf.int32,
                              name='top_class'),
          logits=tf.identity(logits, name='logits'))
      return {'default': (fetches, py_utils.NestedMap(images=images))}

  # --- Decoding (--job=decoder_dev): confusion matrix, per-class accuracy.

  def Decode(self, input_batch):
    logits = self.ComputePredictions(self.theta, input_batch).logits
    return {
        'predicted': tf.argmax(logits, -1, output_type=tf.int32),
        'label': input_batch.label,
        'weight': input_batch.weight,
    }

  def CreateDecoderMetrics(self):
    # Kept for DecodeFinalize, which Lingvo gives only the output path.
    self._dec_metrics = {
        'num_samples_in_batch': metrics_lib.AverageMetric(),
        'confusion': decoding.ConfusionMetric(self.params.num_classes),
    }
    return self._dec_metrics

  def PostProcessDecodeOut(self, dec_out, dec_metrics):
    real = dec_out['weight'] > 0
    dec_metrics['num_samples_in_batch'].Update(int(real.sum()))
    dec_metrics['confusion'].Update(dec_out['label'][real],
                                    dec_out['predicted'][real])
    return []

  def DecodeFinalize(self, decode_finalize_args):
    """Writes confusion-<step>.txt: the matrix and per-class accuracy."""
    decoding.WriteText(
        decoding.OutputPath(decode_finalize_args.decode_out_path,
                            'confusion'),
        self._dec_metrics['confusion'].Text())
