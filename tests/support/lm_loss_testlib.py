"""A tiny LM experiment's train graph and the loss of one fixed batch.

tests/pipeline/test_checkpoint_cuts.py and tests/tools/test_convert_checkpoint.py
compare checkpoints by this loss: the same weights under another cut or
naming give the same number.
"""

import contextlib

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np


def FixedBatch(mp):
  """One batch of mp.input's shape, the same every call (vocabulary 128)."""
  rng = np.random.RandomState(0)
  b, t = mp.input.batch_size, mp.input.seq_len
  return py_utils.NestedMap(
      ids=tf.constant(rng.randint(0, 128, [b, t]), tf.int32),
      labels=tf.constant(rng.randint(0, 128, [b, t]), tf.int32),
      weights=tf.ones([b, t]), example_ids=tf.range(b))


def BuildWithLoss(mp, scope=None):
  """(task, loss of FixedBatch): mp's model and train graph, built here.

  In the caller's graph and cluster; `scope`: a name scope for the loss ops.
  """
  model = mp.Instantiate()
  model.ConstructFPropBPropGraph()
  task = model.GetTask()
  batch = FixedBatch(mp)
  with tf.name_scope(scope) if scope else contextlib.nullcontext():
    predictions = task.ComputePredictions(task.theta, batch)
    loss = task.ComputeLoss(task.theta, predictions, batch)[0]['loss'][0]
  return task, loss
