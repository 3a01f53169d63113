"""The learners' hook: Lingvo learners whose Apply is the active sync's.

`Applying(sync)` makes `sync` (a GradientSync) active while a task builds
its train ops; its learners (SyncLearner, see WithSyncLearners) then apply
through `sync.Apply`.
"""

import contextlib
import threading

import lingvo.compat as tf
from lingvo.core import learner as lingvo_learner
from lingvo.core import py_utils

_ACTIVE = threading.local()


def _Stack():
  if not hasattr(_ACTIVE, 'stack'):
    _ACTIVE.stack = []
  return _ACTIVE.stack


@contextlib.contextmanager
def Applying(sync):
  """SyncLearners' Apply built inside goes through `sync` (a GradientSync)."""
  _Stack().append(sync)
  try:
    yield sync
  finally:
    _Stack().pop()


def _SumDuplicateRows(var_grad):
  """var_grad with a tf.IndexedSlices gradient's repeated rows summed."""
  var, grad = var_grad.var, var_grad.grad
  if not isinstance(grad, tf.IndexedSlices):
    return var_grad
  with tf.device(grad.values.device), tf.name_scope('sum_duplicate_rows'):
    rows, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position,
                                          tf.size(rows))
  return py_utils.VarGrad(var, tf.IndexedSlices(values, rows,
                                                grad.dense_shape),
                          var_grad.scale)


class SyncLearnerMixin:
  """A Learner whose Apply is the active GradientSync's (see Applying).

  Outside `Applying` (evalers, the controller of a cluster, a task without
  a sync) it is the Learner's own Apply. Either way it clips by the norm of
  the gradients with a sparse gradient's repeated rows summed
  (ScaleGradients); every PipelinedTask's learners are of this kind.
  """

  def Apply(self, metrics, vmap, gradient_mask=None, gradient_adjuster=None):
    stack = _Stack()
    if not stack:
      return super().Apply(metrics, vmap, gradient_mask=gradient_mask,
                           gradient_adjuster=gradient_adjuster)
    return stack[-1].Apply(self, metrics, vmap, gradient_mask,
                           gradient_adjuster)

  def ScaleGradients(self, var_grads, gradient_adjuster=None):
    """Lingvo's clipping, by the global norm of the gradients themselves.

    Lingvo's norm sums the squares of a tf.IndexedSlices' rows, so a row
    looked up twice in a batch counts twice; 'recurrent' hands over a
    lookup's gradient dense, the other schedules sparse, so their norms
    (and their clipping) would differ.
    Duplicate rows are summed first (as the optimizer would), so every
    schedule, replica layout and the unpipelined model clip alike.
    """
    return super().ScaleGradients(var_grads.Transform(_SumDuplicateRows),
                                  gradient_adjuster=gradient_adjuster)

  def ApplyOptimizer(self, lr, var_grads):
    """The optimizer's update of var_grads, in the learner's variable scope."""
    with self._SelfVariableScope():
      return tf.group(self.optimizer.Apply(lr, var_grads))


class SyncLearner(SyncLearnerMixin, lingvo_learner.Learner):
  """lingvo.core.learner.Learner through the active GradientSync."""


_SYNC_CLASSES = {lingvo_learner.Learner: SyncLearner}


def _SyncClass(cls):
  if issubclass(cls, SyncLearnerMixin):
    return cls
  if cls not in _SYNC_CLASSES:  # A user's Learner subclass.
    _SYNC_CLASSES[cls] = type(f'Sync{cls.__name__}', (SyncLearnerMixin, cls),
                              {'__module__': __name__})
  return _SYNC_CLASSES[cls]


def WithSyncLearners(task_params):
  """A copy of task_params whose learners apply through GradientSync.

  Legacy learner params (train.learning_rate, optimizer...) become one
  SyncLearner, as Lingvo's BaseTask would make a Learner of them.
  """
  p = task_params.Copy()
  tp = p.train
  if tp.learner is None:
    tp.learner = lingvo_learner.ExtractLearnerFromLegacyParams(
        tp, cls=SyncLearner)
  elif isinstance(tp.learner, (list, tuple)):
    for lp in tp.learner:
      lp.cls = _SyncClass(lp.cls)
  else:
    tp.learner.cls = _SyncClass(tp.learner.cls)
  return p
