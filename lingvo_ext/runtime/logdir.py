"""The trainer's logdir: checked, locked, or already trained to the end."""

import fcntl
import os
import socket

from lingvo_ext import checkpoints
from lingvo_ext.runtime import runner_state
from lingvo_ext.runtime import runners

# The lock a training process holds on its logdir for its whole life (the
# kernel drops it when the process ends, however it ends).
LOCK_FILE = runner_state.TRAINER_LOCK
_LOCK = {}


def Lock(logdir):
  """Takes the logdir's trainer lock; returns an error if another has it."""
  path = os.path.join(logdir, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    with os.fdopen(fd) as f:
      holder = f.read().strip() or 'another process'
    return (f'--logdir={logdir} is in use by the trainer {holder} (it holds '
            f'{path}); one trainer per logdir: wait for it, stop it, or '
            'pass another --logdir.')
  os.ftruncate(fd, 0)
  os.write(fd, f'PID {os.getpid()} on host {socket.gethostname()}\n'.encode())
  _LOCK['fd'] = fd  # Kept open (and locked) until the process exits.
  return None


def Check(logdir):
  """Creates `logdir` if missing; returns an error if it is not usable."""
  if '://' in logdir:
    return None  # A remote file system: Lingvo's gfile calls check it.
  if os.path.exists(logdir) and not os.path.isdir(logdir):
    return (f'--logdir={logdir} is a file, not a directory; pass a directory '
            '(it is created when missing).')
  try:
    os.makedirs(os.path.join(logdir, 'train'), exist_ok=True)
    probe = os.path.join(logdir, 'train', f'.write_test.{os.getpid()}')
    with open(probe, 'w') as f:
      f.write('')
    os.remove(probe)
  except OSError as e:
    return (f'--logdir={logdir} is not writable ({e.strerror}); pass a '
            'directory you can write to.')
  return None


def ResumeStep(o, cfg):
  """(the step training resumes from, or None; the run's max_steps).

  The step of the logdir's latest intact checkpoint (the repair runs once
  per process: runners.RepairCheckpoints).
  """
  path = runners.RepairCheckpoints(os.path.join(o.logdir, 'train'))
  max_steps = cfg.train.max_steps if o.max_steps is None else o.max_steps
  return checkpoints.CheckpointStep(path), max_steps


def AlreadyTrained(o, cfg):
  """The 'nothing to do' line of a finished logdir, or None."""
  train_dir = os.path.join(o.logdir, 'train')
  step, max_steps = ResumeStep(o, cfg)
  if step is None or step < max_steps:
    checkpoints.ClearTrainingFinished(train_dir)
    return None
  checkpoints.MarkTrainingFinished(train_dir, step, max_steps)
  return (f'already trained to step {step} (max_steps {max_steps}): nothing '
          'to do; raise --max_steps to go on.')
