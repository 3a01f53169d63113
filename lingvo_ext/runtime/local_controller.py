"""The trainer's controller: Lingvo's Controller with this project's state.

It shares the in-process trainer's graph and model where one runs beside it
(one_build.py: one build of the model per process); it checkpoints through
checkpoints.TrainingCheckpointer (returned from Lingvo's
`_CreateCheckpointer`): finite saves only, the step kept when a task of a
live cluster restarts; it saves the last checkpoint as soon as the trainer in
its process stops, not up to 10 s later.
"""

import functools
import sys
import time

from lingvo import runners as lingvo_runners
import lingvo.compat as tf
import numpy as np

from lingvo_ext import checkpoints
from lingvo_ext.distributed import step_keeping
from lingvo_ext.preflight import memory_check
from lingvo_ext.runtime import disk_space
from lingvo_ext.runtime import one_build
from lingvo_ext.runtime import runner_state


class LocalController(runner_state.RunnerMixin,
                      one_build.SharedModelControllerMixin,
                      lingvo_runners.Controller):
  """Lingvo's Controller; refuses to checkpoint non-finite variables.

  With `trainer=` (keyword), it shares that trainer's graph and model.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._woken = False
    self._low_space = False
    self._looks = []  # (time.monotonic(), step) of the last two looks.
    if self._checkpointer is not None:
      self._run_state.controller_here.set()
      self._WarnIfLowOnSpace()
      # Built, not yet allocated by a session (a local run: a cluster's
      # variables live in its other tasks).
      line = None if self._options.distributed else (
          memory_check.VariablesWarning(
              memory_check.GraphVariableBytes(self._graph)))
      if line:
        print(line, file=sys.stderr, flush=True)

  def _WarnIfLowOnSpace(self):
    """One warning line when the space left falls below a checkpoint's."""
    line = disk_space.HeadroomWarning(self._train_dir,
                                      self.params.train.save_max_to_keep)
    if line and not self._low_space:
      print(line, file=sys.stderr, flush=True)
      tf.logging.warning('%s', line)
    self._low_space = bool(line)

  def _GetSession(self, **kwargs):
    if getattr(self, '_shared_with', None) is not None:
      # It runs no model computation here (the trainer runs the summaries,
      # one_build.py), only initializers, checks, copies and saves: Grappler
      # would optimize the whole graph for each of them and change nothing.
      kwargs.setdefault('disable_meta_optimizer', True)
    return super()._GetSession(**kwargs)

  def _CreateCheckpointer(self, train_dir, model, *args, **kwargs):
    keeper = None
    if self._options.distributed:
      keeper = functools.partial(step_keeping.StepKeepingRestore,
                                 train_dir=train_dir, job=self._options.job)
    return checkpoints.NewCheckpointer(
        train_dir, model,
        lambda: super(LocalController, self)._CreateCheckpointer(
            train_dir, model, *args, **kwargs),
        on_save_attempt=self._run_state.first_save_done.set,
        step_keeper=keeper, snapshot_lock=self._run_state.step_lock,
        finite_checks=getattr(self._shared_with, 'finite_checks', None))

  def _ShouldStop(self, sess=None, step=None, check_early_stop=True):
    if self._run_state.interrupted.is_set():
      return True  # Lingvo's controller then saves a checkpoint.
    stop = super()._ShouldStop(sess, step, check_early_stop)
    if stop and step is not None and step >= self.params.train.max_steps:
      self._finished_step = int(step)  # Its checkpoint is saved next.
    return stop

  def _Loop(self):
    """Lingvo's Controller._Loop, waking when the trainer here finishes.

    Lingvo's loop sleeps until 10 s after each look at the step, so a local
    run ended up to 10 s after its last step; here that wait ends as soon as
    this process's trainer stops (RunState.trainer_done). A copy: its hash
    and the changes are in _internal/lingvo_runtime.py COPIED.
    """
    with tf.container(self._container_id), self._GetSession() as sess:
      if self._options.interactive:
        self.WriteRunFiles()
        lingvo_runners.StartShell(locals())
        return
      if not self.shares_model:
        # One run (Lingvo's two each prune the whole graph). A shared model's
        # tables, local variables and input are the trainer's: Lingvo's
        # Trainer._Loop initialises them before it waits for the controller.
        sess.run([self._initialize_tables, self._initialize_local_vars])
        for task in self._model.tasks:
          task.input.Initialize(sess)
      tp = self.params.train
      next_summary_step = 1
      if not self._checkpoint_in_controller:
        global_step = self._WaitUntilInit(sess)
      while True:
        next_look = time.time() + min(10, tp.save_interval_seconds)
        if self._checkpoint_in_controller:
          self._checkpointer.RestoreIfNeeded(sess)
        global_step = sess.run(self._model.global_step)
        self._looks = self._looks[-1:] + [(time.monotonic(), int(global_step))]
        if self._ShouldStop(sess, global_step):
          tf.logging.info('Training finished.')
          self.WriteRunFiles()
          if self._checkpoint_in_controller:
            if (self._options.distributed and
                self._run_state.interrupted.is_set()):
              global_step = self._SettledStep(sess, global_step)
            self._checkpointer.Save(sess, global_step)
            if checkpoints.CheckpointStep(tf.train.latest_checkpoint(
                self._train_dir)) == int(global_step):
              self._run_state.final_save.set()
          sess.close()
          self._DequeueThreadComplete()
          return
        if self._checkpoint_in_controller:
          self._MaybeSave(sess, global_step)
        self.WriteRunFiles()  # The trainer steps meanwhile (one_build.py).
        if (self.shares_model and self._summary_op is not None and
            global_step >= next_summary_step):
          # Run with the trainer's next step, on its batch (one_build.py).
          self._run_state.train_summaries.Request()
          next_summary_step = global_step + tp.summary_interval_steps
        elif self._summary_op is not None and global_step >= next_summary_step:
          global_step, summary_str = sess.run(
              [self._model.global_step, self._summary_op])
          next_summary_step = global_step + tp.summary_interval_steps
          if isinstance(summary_str, np.ndarray) and summary_str.size == 0:
            tf.logging.info('Skipping summary: %s', summary_str)
          else:
            self._summary_writer.add_summary(summary_str, global_step)
          tf.logging.info('Write summary @%s', global_step)
          self._SummarizeValue(global_step, 'total_num_params',
                               self._total_num_params)
        self.WaitForNextLook(next_look)

  def _SettledStep(self, sess, step):
    """A cluster's step once its trainer client stopped stepping.

    On a stop request the client (another process) ends its step in flight
    after this controller woke: the step is read until it holds still for
    three steps' time (0.5 s at least, half --shutdown_grace_secs at most).
    """
    grace_s = self._options.shutdown_grace_secs
    quiet = 0.5
    if len(self._looks) == 2 and self._looks[1][1] > self._looks[0][1]:
      (t0, s0), (t1, s1) = self._looks
      quiet = min(max(quiet, 3 * (t1 - t0) / (s1 - s0)), grace_s / 2)
    now = time.monotonic()
    deadline, since = now + grace_s, now
    while now < deadline and now - since < quiet:
      time.sleep(0.1)
      seen = int(sess.run(self._model.global_step))
      now = time.monotonic()
      if seen != step:
        step, since = seen, now
    return step

  def _MaybeSave(self, sess, global_step):
    """Lingvo's MaybeSave; the trainer may step while the save is written.

    With Lingvo's async saver, Save returns once the variables are copied
    and RunState.first_save_done is set then (the trainer waits for it); the
    write is waited for here, as a sync save does, and the checkpoint dropped
    if it is not finite.
    """
    self._WarnIfLowOnSpace()
    if self._checkpointer.MaybeSave(sess, global_step, sync=False):
      self._checkpointer.FinishSave()

  def WaitForNextLook(self, deadline):
    """Sleeps until `deadline` (time.time()) or until the trainer stops.

    Only the first wait after the trainer stopped is cut short: should the
    controller go on (its own stop rule not met), it looks every 10 s again.
    A cluster's controller (its trainer in another process) also wakes on
    a stop request (a signal, an input fault): the save is next.
    """
    state = self._run_state
    if self._woken:
      time.sleep(max(0.0, deadline - time.time()))
      return
    while not (state.interrupted.is_set() and self._options.distributed):
      left = deadline - time.time()
      if left <= 0:
        return
      if state.trainer_done.wait(min(left, 0.25)):
        self._woken = True
        return

  def _DequeueThreadComplete(self):
    super()._DequeueThreadComplete()
    step = getattr(self, '_finished_step', None)
    if step is not None and self._checkpointer is not None:
      # After the last save: evalers and decoders stop at that checkpoint.
      checkpoints.MarkTrainingFinished(self._train_dir, step,
                                       self.params.train.max_steps)
