"""Gradient accumulation in TensorFlow's (Sparse)ConditionalAccumulators.

One accumulator per variable takes every replica's gradient of a step (the
parameter-server strategy) and the gradients of accumulate_steps steps, and
releases their mean once all have arrived; sparse gradients stay
IndexedSlices. `Pending.Take` is the gradient an update applies (zeros on
steps that do not update).
"""

import dataclasses

import lingvo.compat as tf
from lingvo.core import py_utils

from lingvo_ext._internal import tf as internal_tf


def Accumulate(grads, var, device, steps, force=False):
  """A Pending for `grads` (this step's, one per source) of `var`.

  Args:
    grads: The gradients of this step to average, dense or IndexedSlices.
    var: The variable they are for.
    device: Where the accumulator lives.
    steps: Steps per update (accumulate_steps).
    force: Accumulate even a single gradient of a single step.

  Returns:
    A Pending: the gradient itself, or an accumulator that yields the mean
    of len(grads) * steps gradients.
  """
  required = len(grads) * steps
  if required == 1 and not force:
    return Pending(grad=grads[0])
  sparse = isinstance(grads[0], tf.IndexedSlices)
  with tf.device(device), tf.name_scope('accumulate'):
    shape = var.shape
    if sparse:
      acc = tf.compat.v1.SparseConditionalAccumulator(
          var.dtype, shape=shape, reduction_type='SUM')
    else:
      acc = tf.compat.v1.ConditionalAccumulator(
          var.dtype, shape=shape, reduction_type='SUM')
    # Gradients of an older update would be dropped; none is older than the
    # global step.
    step = tf.cast(py_utils.GetGlobalStep(), tf.int64)
    applies = []
    for g in grads:
      if sparse:
        applies.append(
            acc.apply_indexed_slices_grad(
                tf.IndexedSlices(g.values, tf.cast(g.indices, tf.int64),
                                 tf.cast(g.dense_shape, tf.int64)),
                local_step=step))
      else:
        applies.append(acc.apply_grad(g, local_step=step))
    with tf.control_dependencies(applies):
      ready = tf.greater_equal(acc.num_accumulated(), required)
  return Pending(acc=acc, sparse=sparse, required=required, ready=ready,
                 device=device, var=var)


@dataclasses.dataclass
class Pending:
  """A gradient, or the accumulator that yields it once `ready`."""
  grad: object = None
  acc: object = None
  sparse: bool = False
  required: int = 1
  ready: object = None
  device: str = ''
  var: object = None

  def Take(self):
    """The gradient to apply (zeros on steps that do not update)."""
    if self.acc is None:
      return self.grad
    scale = 1.0 / self.required
    with tf.device(self.device):
      if self.sparse:
        shape = self.var.shape.as_list()

        def TakeSlices():
          g = self.acc.take_indexed_slices_grad(self.required)
          return g.values * scale, g.indices

        def NoSlices():
          return (tf.zeros([0] + shape[1:], self.var.dtype),
                  tf.zeros([0], tf.int64))

        with internal_tf.V1ControlFlow():
          values, indices = tf.cond(self.ready, TakeSlices, NoSlices)
        return tf.IndexedSlices(values, indices,
                                tf.constant(shape, tf.int64))
      with internal_tf.V1ControlFlow():
        return tf.cond(self.ready,
                       lambda: self.acc.take_grad(self.required) * scale,
                       lambda: tf.zeros(self.var.shape, self.var.dtype))
