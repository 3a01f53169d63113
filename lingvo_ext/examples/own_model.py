r"""Your own model, all the way: a layer, a pipelined task and an experiment.

A residual-MLP classifier of scikit-learn's 8x8 digits, cut into 2 pipeline
cells over 4 micro-batches. The three parts a new model needs:

1. A layer (`ResidualMlpLayer`): `Params()` with a docstring for every
   param, variables made in `_CreateLayerVariables`, `FProp(theta, x)`, and
   the classmethod `FPropMeta(p, x_shape)` giving its FLOPs and output shape
   without building it (PartitionSequentialLayers balances cells with it).
2. A task on `PipelinedTask` (`ResidualMlpClassifier`): `LayerStack(p)`
   returns the flat list of layer params and the input shape of a batch; the
   task cuts it into `num_partitions` cells and builds the pipeline as the
   child `self.pipeline`. `ComputePredictions` runs it, `ComputeLoss`
   returns Lingvo's metrics (each `(value, weight)`; `loss` is minimized).
3. An experiment on `params.base.PipelinedExperiment`
   (`ResidualMlpDigits`): `_InputParams(split)` and `_TaskParams()`, with
   the pipeline and training settings as class attributes, registered with
   `@model_registry.RegisterSingleTaskModel`.

Train it (here, or copied outside the repository with its directory on
PYTHONPATH and `--model=own_model.ResidualMlpDigits`), evaluate its last
checkpoint, and switch the pipeline schedule by override:

  .venv/bin/python -m lingvo_ext.trainer \
      --model=lingvo_ext.examples.own_model.ResidualMlpDigits \
      --logdir=/tmp/lx/own --max_steps=60
  .venv/bin/python -m lingvo_ext.trainer \
      --model=lingvo_ext.examples.own_model.ResidualMlpDigits \
      --logdir=/tmp/lx/own --job=evaler_dev
  .venv/bin/python -m lingvo_ext.trainer \
      --model=lingvo_ext.examples.own_model.ResidualMlpDigits \
      --logdir=/tmp/lx/own --max_steps=80 \
      --model_params_override='task.schedule:"1f1b"'

`.venv/bin/python -m lingvo_ext.examples.own_model --logdir=DIR ...` is the
first command (the trainer with this --model).
"""

import sys

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-bad-import-order

# isort: split
from lingvo import model_registry
import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_ext import layers
from lingvo_ext.layers import flops
from lingvo_ext.tasks import pipelined_task
from lingvo_ext.tasks.image import input_generator
from params import base

MODEL = 'lingvo_ext.examples.own_model.ResidualMlpDigits'


# --- 1. The layer ---------------------------------------------------------------


class ResidualMlpLayer(base_layer.BaseLayer):
  """x + W2 relu(W1 x + b1) + b2 on [batch, dim]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 0, 'Depth of the input and the output.')
    p.Define('hidden_dim', 0, 'Depth of the hidden layer.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.dim <= 0 or p.hidden_dim <= 0:
      raise ValueError(f'{p.name}: dim={p.dim} and hidden_dim={p.hidden_dim} '
                       'must be positive.')

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    for name, shape in (('w1', [p.dim, p.hidden_dim]), ('b1', [p.hidden_dim]),
                        ('w2', [p.hidden_dim, p.dim]), ('b2', [p.dim])):
      init = (p.params_init if name.startswith('w') else
              py_utils.WeightInit.Constant(0.0))
      self.CreateVariable(
          name, py_utils.WeightParams(shape=shape, init=init, dtype=p.dtype))

  def FProp(self, theta, x):
    """Returns x + the MLP of x, the shape of x."""
    h = tf.nn.relu(tf.matmul(x, theta.w1) + theta.b1)
    return x + tf.matmul(h, theta.w2) + theta.b2

  @classmethod
  def FPropMeta(cls, p, x):
    """FLOPs and output shape of FProp on an input of tshape.Shape `x`."""
    py_utils.CheckShapes((x,))
    rows = x.num_elements() // p.dim
    num_flops = (flops.FCFlops(rows, p.dim, p.hidden_dim, 'RELU') +
                 flops.FCFlops(rows, p.hidden_dim, p.dim) +
                 flops.ElementwiseFlops(rows * p.dim))
    return py_utils.NestedMap(flops=flops.ToInt(num_flops), out_shapes=(x,))


# --- 2. The task ------------------------------------------------------------------


class ResidualMlpClassifier(pipelined_task.PipelinedTask):
  """Flatten, project, residual-MLP blocks and a softmax head, pipelined."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_classes', 10, 'Number of classes.')
    p.Define('model_dim', 32, 'Depth of the residual stream.')
    p.Define('hidden_dim', 64, 'Depth of each block\'s hidden layer.')
    p.Define('num_blocks', 4, 'Number of residual-MLP blocks.')
    return p

  @classmethod
  def LayerStack(cls, task_params):
    """The layers in order, and the shape of one training batch's images."""
    p = task_params
    cls._CheckHasInput(p)
    h, w, c = p.input.data_shape
    stack = [
        layers.FlattenLayer.Params().Set(name='flatten'),
        layers.FCLayer.Params().Set(
            name='proj', input_dim=h * w * c, output_dim=p.model_dim,
            activation='RELU'),
    ]
    stack += [
        ResidualMlpLayer.Params().Set(
            name=f'block{i}', dim=p.model_dim, hidden_dim=p.hidden_dim)
        for i in range(p.num_blocks)
    ]
    stack.append(layers.SoftmaxLayer.Params().Set(
        name='head', input_dim=p.model_dim, num_classes=p.num_classes))
    return stack, (tshape.Shape([p.input.batch_size, h, w, c]),)

  def ComputePredictions(self, theta, input_batch):
    return py_utils.NestedMap(
        logits=self.pipeline.FProp(theta.pipeline, input_batch.data))

  def ComputeLoss(self, theta, predictions, input_batch):
    # Padding examples of the last dev batch have weight 0.
    weights = input_batch.weight
    num = tf.reduce_sum(weights)
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=input_batch.label, logits=predictions.logits)
    loss = tf.reduce_sum(xent * weights) / tf.maximum(num, 1.0)
    correct = tf.cast(
        tf.equal(
            tf.argmax(predictions.logits, -1, output_type=tf.int32),
            input_batch.label), tf.float32)
    accuracy = tf.reduce_sum(correct * weights) / tf.maximum(num, 1.0)
    metrics = {'loss': (loss, num), 'accuracy': (accuracy, num)}
    return metrics, {'loss': xent}


# --- 3. The experiment --------------------------------------------------------------


@model_registry.RegisterSingleTaskModel
class ResidualMlpDigits(base.PipelinedExperiment):
  """ResidualMlpClassifier on the 8x8 digits: 2 cells, 4 micro-batches."""

  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 4
  LEARNING_RATE = 3e-3
  MAX_STEPS = 300
  SAVE_INTERVAL_SECONDS = 5
  SUMMARY_INTERVAL_STEPS = 10

  def _InputParams(self, split):
    return input_generator.ImageInput.Params().Set(
        split=split, data_shape=(8, 8, 1), num_classes=10, batch_size=16)

  def _TaskParams(self):
    return ResidualMlpClassifier.Params().Set(
        name='own', num_classes=10, model_dim=32, hidden_dim=64, num_blocks=4)


if __name__ == '__main__':
  from lingvo_ext import trainer  # pylint: disable=g-import-not-at-top
  sys.exit(trainer.Run([sys.argv[0], f'--model={MODEL}'] + sys.argv[1:]))
