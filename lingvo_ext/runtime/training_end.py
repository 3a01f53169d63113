"""Where training ends, as the trainer defines it: evalers and decoders follow.

The trainer records the --max_steps it runs with in
LOGDIR/train/training_max_steps (`Record`, atomically, at each start; a
resume with another value rewrites it), and its controller marks the end
with `training_finished` (checkpoints.MarkTrainingFinished). An evaler or
decoder (`End`) stops after the checkpoint of the first of: its own
--max_steps when given, else the trainer's recorded one, else (no trainer
has recorded one) the experiment's train.max_steps, which it says in one
line; and the checkpoint `training_finished` names, whichever comes first.
"""

import os
import sys

import lingvo.compat as tf

MAX_STEPS_FILE = 'training_max_steps'


def Record(train_dir, max_steps):
  """Records the trainer's max_steps in `train_dir` (unless already so)."""
  if Recorded(train_dir) == int(max_steps):
    return
  path = os.path.join(train_dir, MAX_STEPS_FILE)
  tf.io.gfile.makedirs(train_dir)
  temp = f'{path}.tmp{os.getpid()}'
  with tf.io.gfile.GFile(temp, 'w') as f:
    f.write(f'{int(max_steps)}\n')
  tf.io.gfile.rename(temp, path, overwrite=True)


def Recorded(train_dir):
  """The max_steps the trainer of `train_dir` runs with, or None."""
  try:
    with tf.io.gfile.GFile(os.path.join(train_dir, MAX_STEPS_FILE)) as f:
      return int(f.read().strip())
  except (tf.errors.NotFoundError, ValueError):
    return None


class End:
  """The step an evaler or decoder stops after; says where it comes from.

  Args:
    job: The job's name (`evaler_dev`), for its lines.
    train_dir: The trainer's checkpoint directory.
    flag_max_steps: The job's own --max_steps, or None.
    default_max_steps: The experiment's train.max_steps.
    quiet: Whether to say nothing (training runs in this process).
  """

  def __init__(self, job, train_dir, flag_max_steps, default_max_steps,
               quiet=False):
    self._job = job
    self._train_dir = train_dir
    self._flag = flag_max_steps
    self._default = default_max_steps
    self._quiet = quiet
    self._said = None

  def Step(self):
    """The last step to evaluate; the reason is said once per change."""
    if self._flag is not None:
      return self._flag
    recorded = Recorded(self._train_dir)
    path = os.path.join(self._train_dir, MAX_STEPS_FILE)
    if recorded is not None:
      step, line = recorded, (
          f'{self._job}: following the trainer: it stops after the '
          f'checkpoint of step {recorded}, the trainer\'s max_steps (in '
          f'{path}), or at training_finished.')
    else:
      step, line = self._default, (
          f'{self._job}: no trainer has recorded its max_steps in {path}: '
          f'evaluating each new checkpoint until the one of step '
          f'{self._default} (the experiment\'s train.max_steps; --max_steps '
          'sets it), or training_finished.')
    if (step, recorded is None) != self._said:
      self._said = (step, recorded is None)
      tf.logging.info('%s', line)
      if not self._quiet:
        print(line, file=sys.stderr, flush=True)
    return step

  def Says(self):
    """What the job waits for, for its 'waiting' lines."""
    if self._flag is not None:
      return f'it stops after the checkpoint of step {self._flag}, --max_steps'
    recorded = Recorded(self._train_dir)
    if recorded is None:
      return (f'it stops after the checkpoint of step {self._default}, the '
              "experiment's train.max_steps")
    return (f'it stops after the checkpoint of step {recorded}, the '
            "trainer's max_steps")
