"""A second kind of Lingvo GPipe user: a stack from Lingvo's
batch_major_attention.Builder (num_splits/num_micro_batches), whose
_MaybeSplit builds lingvo.core.gpipe.PipeliningLayer params, in a task.
`Write(dir)` writes the module `lingvo_builder_stack.py`.
"""

import os

EXPERIMENT = '''
"""A user's task around a Lingvo Builder stack split for GPipe."""
import lingvo.compat as tf
import numpy as np
from lingvo import model_registry
from lingvo.core import base_model
from lingvo.core import base_model_params
from lingvo.core import batch_major_attention
from lingvo.core import optimizer
from lingvo.core import py_utils
from lingvo.core import schedule
from lingvo_ext.tasks import in_memory_input


class Vectors(in_memory_input.InMemoryInput):

  def _LoadExamples(self):
    rng = np.random.RandomState(0)
    x = rng.randn(64, 5, 16).astype(np.float32)
    return py_utils.NestedMap(x=x, y=np.tanh(x[:, ::-1]))


class BuilderTask(base_model.BaseTask):

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stack', None, 'The Builder stack.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('stack', self.params.stack)

  def ComputePredictions(self, theta, input_batch):
    x = input_batch.x
    out = self.stack.FProp(theta.stack, py_utils.NestedMap(
        vec=x, paddings=tf.zeros(tf.shape(x)[:2], x.dtype)))
    return out.vec

  def ComputeLoss(self, theta, predictions, input_batch):
    loss = tf.reduce_mean(tf.square(predictions - input_batch.y))
    return {'loss': (loss, tf.constant(1.0))}, {}


@model_registry.RegisterSingleTaskModel
class BuilderStack(base_model_params.SingleTaskModelParams):

  def Train(self):
    return Vectors.Params().Set(batch_size=8)

  def Task(self):
    builder = batch_major_attention.Builder.Params().Set(
        model_dim=16, num_heads=2, ff_hidden_dim=32, num_splits=2,
        num_micro_batches=2, deterministic_dropout=True).Instantiate()
    p = BuilderTask.Params().Set(
        name='builder', stack=builder.TransformerEncoderStack('stack', 2))
    p.train.learning_rate = 1e-3
    p.train.optimizer = optimizer.Adam.Params()
    p.train.lr_schedule = schedule.ConstantOne.Params()
    p.train.max_steps = 2
    p.train.save_interval_steps = 1000
    return p
'''
MODULE = 'lingvo_builder_stack'
MODEL = MODULE + '.BuilderStack'


def Write(root):
  """Writes the experiment module in `root`."""
  with open(os.path.join(str(root), MODULE + '.py'), 'w') as f:
    f.write(EXPERIMENT)
