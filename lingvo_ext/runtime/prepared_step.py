"""The trainer's step, built while it waits for the controller.

Lingvo's trainer waits until the controller has initialized (or restored)
the variables and written the first checkpoint, then runs its first step,
whose Session.run first prunes, places and optimizes the step's graph: for a
small model most of the first step's time. `PreparedStep` builds that graph
ahead, through a callable (Session::MakeCallable), while the trainer waits;
TensorFlow releases the GIL meanwhile, so the controller's initialization and
save run beside it. Its steps then run through the callable: the same graph
and kernels, so the same values, as Session.run. Single-process runs only:
across processes a callable reports a lost worker differently from
Session.run.
"""

import lingvo.compat as tf

from lingvo_ext._internal import tf as internal_tf


class PreparedStep:
  """Lingvo's training step [train_op, eval_metrics, per_example] of a task."""

  def __init__(self, sess, task):
    self.fetches = [task.train_op, task.eval_metrics, task.per_example_tensors]
    flat = tf.nest.flatten(self.fetches[1:])
    # Each tensor fetched once (Session.run dedups too), in first-seen order.
    position = {name: i for i, name in enumerate(
        dict.fromkeys(t.name for t in flat))}
    names = list(position)
    self._index = [position[t.name] for t in flat]
    self._callable = internal_tf.MakeCallable(sess, names,
                                              [task.train_op.name])

  def Matches(self, fetches) -> bool:
    """Whether `fetches` (a Session.run's) are this step's, unchanged."""
    return (isinstance(fetches, (list, tuple)) and
            len(fetches) == len(self.fetches) and
            all(a is b for a, b in zip(fetches, self.fetches)))

  def Run(self):
    """The step's values, as Session.run returns them for `fetches`."""
    values = self._callable()
    # Session.run gives a scalar tensor's value as a numpy scalar.
    values = [v[()] if getattr(v, 'ndim', None) == 0 else v for v in values]
    return [None] + tf.nest.pack_sequence_as(
        self.fetches[1:], [values[i] for i in self._index])


def Prepare(sess, task):
  """A PreparedStep of `task` on `sess`; None if TensorFlow cannot build it."""
  try:
    return PreparedStep(sess, task)
  except (tf.errors.OpError, ValueError, TypeError) as e:
    # Session.run builds it at the first step instead, as without this.
    tf.logging.warning('Not building the training step ahead: %s', e)
    return None
