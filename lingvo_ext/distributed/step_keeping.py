"""Step keeping in a live cluster: a restarted task never rewinds the step.

The controller's checkpointer (checkpoints.TrainingCheckpointer) restores
through `StepKeepingRestore`; the trainer client raises a restored step with
`KeepTrainerStep`.
"""

import os
import sys

import lingvo.compat as tf
from lingvo.core import py_utils

from lingvo_ext._internal import lingvo as internal_lingvo


def _StepLine(job, message):
  print(f'{job}: {message}', file=sys.stderr, flush=True)
  tf.logging.info('%s', message)


class StepKeepingRestore:
  """The controller's restore in a live cluster: weights back, step kept.

  When a worker restarts, its variables are uninitialized and Lingvo's
  controller restores every variable from the last checkpoint, the global
  step too: the step counter would fall back to the checkpoint's step and
  the trainer would redo (and summarize again) the steps since. Instead,
  once the run is live (the step counter is initialized, or this controller
  has seen a step), this restores every variable BUT the global step from
  the last checkpoint; a global step that was lost with its worker is set to
  the highest step this controller has seen (the trainer raises it further
  to its own last step, see `KeepTrainerStep`). The updates of the steps
  since that checkpoint are lost; their step numbers are not reused.

  At the start of a run (nothing seen, counter uninitialized) it is Lingvo's
  RestoreIfNeeded: initialize, or restore the last checkpoint whole.

  Built in the controller's graph, after the checkpointer's saver.
  """

  def __init__(self, models, train_dir, job):
    self._train_dir = train_dir
    self._job = job
    self.max_seen = None
    self._global_step = py_utils.GetOrCreateGlobalStepVar()
    gs_name = self._global_step.op.name
    # What Lingvo's checkpointer saves, by checkpoint key.
    var_list = {
        k: v for k, v in internal_lingvo.SaveableVariables(models).items()
        if v.op.name != gs_name and k != 'global_step'
    }
    self._saver = tf.train.Saver(var_list=var_list) if var_list else None
    # The rest (e.g. Lingvo's async_ckpt/ copies of the variables, which
    # checkpoints do not hold) starts afresh, as Lingvo's restore does.
    saved = {v.op.name for v in var_list.values()} | {gs_name}
    self._init_rest = tf.variables_initializer(
        [v for v in tf.global_variables() if v.op.name not in saved])
    self._step_value = tf.placeholder(tf.int64, [], name='keep_step_value')
    self._assign_step = self._global_step.assign(self._step_value)
    self._read_step = self._global_step.read_value()

  def Seen(self, step):
    if step is not None:
      self.max_seen = max(int(step), self.max_seen or 0)

  def Restore(self, sess, names, lingvo_restore):
    """Restores after `names` (bytes) were found uninitialized.

    Args:
      sess: The controller's session.
      names: The uninitialized variables' names (non-empty).
      lingvo_restore: Lingvo's RestoreIfNeeded(sess), for a run's start.

    Returns:
      The restored checkpoint's path, or what lingvo_restore returned.
    """
    step_lost = any(n == b'global_step' for n in names)
    path = tf.train.latest_checkpoint(self._train_dir)
    if (step_lost and self.max_seen is None) or not path or not self._saver:
      out = lingvo_restore()
      self.Seen(sess.run(self._read_step))
      return out
    self._saver.restore(sess, path)
    sess.run(self._init_rest)
    saved = int(tf.train.load_checkpoint(path).get_tensor('global_step'))
    if step_lost:
      step = max(saved, self.max_seen or 0)
      sess.run(self._assign_step, {self._step_value: step})
    else:
      step = int(sess.run(self._read_step))
    self.Seen(step)
    _StepLine(self._job, RestoredLine(len(names), names[0].decode(),
                                      os.path.basename(path), saved, step))
    return path


def RestoredLine(num_uninitialized, example, checkpoint, saved, step):
  """The controller's line after restoring the weights in a live run.

  `step` is where this controller sets the counter; the trainer raises it to
  its own last step (KeepTrainerStep says so), so the lost updates are named
  from the checkpoint on, not as a range this controller cannot know the
  end of.
  """
  return (f'{num_uninitialized} variable(s) were uninitialized (e.g. '
          f'{example}: a restarted task); restored the weights of '
          f'{checkpoint} (saved at step {saved}); the step counter goes on '
          f'from {step}, or from the trainer\'s last step if that is higher '
          f'(the trainer says so); the updates of the steps after {saved} are '
          'lost.')


def TrainerStepLine(global_step, last):
  """The trainer's line when it raises a restored global step."""
  return (f'the global step was {global_step} (a restored checkpoint); set '
          f'it back to {last}, the last step this trainer ran, so that no '
          f'step number is reused (the updates of steps {global_step + 1}..'
          f'{last} are lost).')


class KeepTrainerStep:
  """The trainer raises a global step that went below its last step.

  The trainer client is the one process that steps, so it knows the last
  step it ran; when it starts its loop again after a failure (a lost task),
  it sets a lower global step (one restored from a checkpoint) back to that
  step before it runs another. No step number is summarized twice.
  """

  def __init__(self, graph, job, distributed):
    self.last = 0
    self._job = job
    if not distributed:
      return
    with graph.as_default():
      gs = py_utils.GetOrCreateGlobalStepVar()
      self._value = tf.placeholder(tf.int64, [], name='keep_trainer_step')
      self._assign = gs.assign(self._value)

  def Ran(self, step):
    self.last = max(self.last, int(step))

  def Keep(self, sess, global_step):
    """Returns the global step to go on from after _WaitUntilInit."""
    global_step = int(global_step)
    if global_step < self.last:
      sess.run(self._assign, {self._value: self.last})
      _StepLine(self._job, TrainerStepLine(global_step, self.last))
      return self.last
    self.Ran(global_step)
    return global_step
