"""What the runners of one trainer process share.

`RunState` is the state the runner threads of one process tell each other
(set by signals, the controller's saves and the trainer's end);
`RunnerMixin` gives each of Lingvo's runner classes that state, the
trainer's `Options` and N CPU devices per session; `Fail` stops the process
from a runner thread with a one-line error; `Waiting` says on stderr what a
job waits for; `TrainerRuns` tells whether a live process trains on a
logdir (its TRAINER_LOCK).
"""

import dataclasses
import fcntl
import os
import sys
import threading
import time

import lingvo.compat as tf

from lingvo_ext import checkpoints
from lingvo_ext._internal import process
from lingvo_ext.distributed import faults
from lingvo_ext.distributed import server
from lingvo_ext.runtime import disk_space
from lingvo_ext.runtime import one_build
from lingvo_ext.runtime import progress


@dataclasses.dataclass
class RunState:
  """What the runner threads of one trainer process tell each other.

  interrupted: set by the first SIGTERM, SIGHUP or Ctrl-C (shutdown.py): the
    trainer stops after its step, the controller saves a checkpoint and
    stops, evalers and decoders stop after the checkpoint they are on.
  stop_signal: the signal that set `interrupted`.
  input_problem: the line of an input fault that set `interrupted`
    (input_guard.py): the run saves, then exits 65.
  final_save: the controller saved the step it stopped at.
  train_summaries: the controller's train summaries, run with a step of the
    trainer whose model it shares (one_build.py).
  controller_here: a controller runs in this process. In a new run its
    trainer waits for `first_save_done`, so that the first checkpoint holds
    the initial weights rather than whatever step the trainer reached.
  trainer_done: this process's trainer loop has ended (max_steps, Ctrl-C,
    early stop): the controller, which looks at the step every 10 s, looks
    at once and saves the last checkpoint.
  step_lock: held by this process's trainer around each training step and
    by its controller around a checkpoint's snapshot of the variables and
    step, so that a checkpoint holds the weights of the step it is named by.
  plan_check: the trainer's plan_check.PlanCheck, told of each step; None
    for a run too short for one.
  """
  interrupted: threading.Event = dataclasses.field(
      default_factory=threading.Event)
  controller_here: threading.Event = dataclasses.field(
      default_factory=threading.Event)
  first_save_done: threading.Event = dataclasses.field(
      default_factory=threading.Event)
  trainer_done: threading.Event = dataclasses.field(
      default_factory=threading.Event)
  final_save: threading.Event = dataclasses.field(
      default_factory=threading.Event)
  train_summaries: one_build.TrainSummaries = dataclasses.field(
      default_factory=one_build.TrainSummaries)
  step_lock: threading.Lock = dataclasses.field(
      default_factory=threading.Lock)
  stop_signal: int = 0
  input_problem: str = ''
  plan_check: object = None


def Fail(message, code):
  """Stops the whole process from a runner thread with a one-line error.

  The line is printed once on stderr; the log file gets it too.
  """
  progress.LogToFileOnly(message)
  tf.logging.flush()
  sys.stdout.flush()
  print(f'error: {message}', file=sys.stderr, flush=True)
  process.ExitNow(code)


def FirstLine(e):
  return str(getattr(e, 'message', e)).strip().split('\n')[0]


# The lock a training process holds on its logdir for its whole life (the
# kernel drops it when the process ends, however it ends).
TRAINER_LOCK = 'trainer.lock'


def TrainerRuns(logdir):
  """Whether a live process holds `logdir`'s trainer lock."""
  path = os.path.join(logdir, TRAINER_LOCK)
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
  except OSError:
    return True
  finally:
    os.close(fd)


# Seconds between two "waiting for ..." lines of a job that waits.
WAIT_MESSAGE_INTERVAL_S = 30.0


class Waiting:
  """Says on stderr what a job waits for: at once, then now and then."""

  def __init__(self):
    self._last = {}

  def Say(self, key, message, once=False):
    now = time.time()
    if once and key in self._last:
      return
    if now - self._last.get(key, -1e9) >= WAIT_MESSAGE_INTERVAL_S:
      self._last[key] = now
      print(message, file=sys.stderr, flush=True)
      tf.logging.info('%s', message)


class RunnerMixin(disk_space.StopOnDiskFullMixin,
                  faults.LostTaskReportMixin):
  """Takes the manager's state and options; N CPU devices per session."""

  def __init__(self, *args, run_state, options, **kwargs):
    self._run_state = run_state
    self._options = options
    super().__init__(*args, **kwargs)

  def _KeepErrorsInLogFile(self):
    progress.KeepErrorsInLogFile()

  @property
  def stopped(self):
    """Whether its loop has finished (Lingvo's _DequeueThreadComplete)."""
    return self._dequeue_thread_complete

  def _GetSession(self, **kwargs):
    # BaseRunner._GetSession with device_count; it matters for in-process
    # sessions (tf_master=''), e.g. an evaler running beside the trainer.
    config = server.SessionConfig(self._options, **kwargs)
    return self.NamingLostTasks(
        tf.Session(self._tf_master, graph=self._graph, config=config))

  def _ReportLostTask(self, error, retrying):
    ends_job = super()._ReportLostTask(error, retrying)
    if ends_job and not self._options.stderrthreshold:
      # Its one line said: the traceback Lingvo logs next stays in the file.
      progress.KeepErrorsInLogFile()
    return ends_job

  def _CreateCheckpointer(self, train_dir, model, *args, **kwargs):
    # Restores a checkpoint of another cut of the pipeline too.
    return checkpoints.NewCheckpointer(
        train_dir, model,
        lambda: super(RunnerMixin, self)._CreateCheckpointer(
            train_dir, model, *args, **kwargs))
