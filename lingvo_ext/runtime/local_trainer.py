"""The trainer's trainer: Lingvo's Trainer and the session it steps with.

`LocalTrainer` retries a non-finite step at once, at most
--max_nonfinite_steps times; polls for the controller instead of sleeping
30 s. Its session (`_TrainerSession`) reports each step to the progress line,
traces --trace_train_step, fetches the train summaries a controller sharing
the model asks for (one_build.py) and runs the step built while the trainer
waited for the controller (prepared_step.py).
"""

import contextlib
import os
import re
import threading
import time

from lingvo import runners as lingvo_runners
import lingvo.compat as tf
from lingvo.core import py_utils

from lingvo_ext import checkpoints
from lingvo_ext.core import jit_choice
from lingvo_ext.distributed import server
from lingvo_ext.distributed import step_keeping
from lingvo_ext.pipeline import cuts
from lingvo_ext.runtime import prepared_step
from lingvo_ext.runtime import progress
from lingvo_ext.runtime import runner_state
from lingvo_ext.tracing import timeline


class _TrainerSession(tf.Session):
  """The trainer's session: reports each training step; traces one.

  Lingvo's trainer loop runs [train_op, eval_metrics, per_example] and then
  fetches the global step; `on_step(global_step, eval_metrics)` is called
  then, with the train step's Session.run seconds (`run_s`). The n-th train step (`trace_step`) runs with FULL_TRACE and its
  RunMetadata is written to `trace_path`. A step also fetches the train
  summaries a controller sharing the model asked for (`summaries`, a
  one_build.TrainSummaries), delivered with the global step after it. Each
  train step holds `step_lock` (RunState.step_lock: a controller here takes
  a checkpoint's snapshot between steps).
  """

  def __init__(self, *args, model, on_step=None, trace_step=0,
               trace_path='', summaries=None, step_lock=None, **kwargs):
    super().__init__(*args, **kwargs)
    self._model = model
    self._step_lock = step_lock or contextlib.nullcontext()
    self._on_step = on_step
    self._summaries = summaries
    self._summary = None
    self._trace_step = trace_step
    self._trace_path = trace_path
    self._train_steps = 0
    self._metrics = None
    self._run_s = None
    self._prepared = None
    self._preparing = None

  def PrepareStep(self, task):
    """Starts building `task`'s training step in a thread (prepared_step.py).

    The first training step waits for it.
    """
    if self._preparing or self._prepared:
      return

    def Build():
      self._prepared = prepared_step.Prepare(self, task)
      if self._prepared:
        tf.logging.info('Built the training step ahead of its first run.')

    self._preparing = threading.Thread(target=Build, name='prepare_step',
                                       daemon=True)
    self._preparing.start()

  def _WaitPrepared(self):
    if self._preparing:
      self._preparing.join()
      self._preparing = None

  def _IsTrainStep(self, fetches):
    # Trainer._Loop's fetches: _internal/lingvo_runtime.py TRAIN_STEP_FETCHES.
    if not isinstance(fetches, (list, tuple)) or not fetches:
      return False
    return any(fetches[0] is t.train_op for t in self._model.tasks)

  def _IsGlobalStep(self, fetches):
    return any(fetches is s for s in [self._model.global_step] +
               [t.global_step for t in self._model.tasks])

  def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
    if not self._IsTrainStep(fetches):
      out = super().run(fetches, feed_dict, options, run_metadata)
      if self._IsGlobalStep(fetches):
        if self._metrics is not None:
          metrics, self._metrics = self._metrics, None
          self._on_step(int(out), metrics, self._run_s)
        if self._summary is not None:
          summary, self._summary = self._summary, None
          self._summaries.Deliver(summary, int(out))
      return out
    summary_op = self._summaries.Fetch() if self._summaries else None
    if summary_op is not None:
      fetches = list(fetches) + [summary_op]
    self._WaitPrepared()  # Not holding the lock: the build takes a while.
    with self._step_lock:
      start = time.perf_counter()
      out = self._RunTrainStep(fetches, feed_dict, options, run_metadata)
      self._run_s = time.perf_counter() - start
    if summary_op is not None:
      self._summary, out = out[-1], out[:-1]
    if self._on_step and len(out) > 1:
      self._metrics = out[1]
    return out

  def _RunTrainStep(self, fetches, feed_dict, options, run_metadata):
    self._train_steps += 1
    if self._train_steps == self._trace_step and options is None:
      options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
      run_metadata = tf.RunMetadata()
      out = super().run(fetches, feed_dict, options, run_metadata)
      with tf.io.gfile.GFile(self._trace_path, 'wb') as f:
        f.write(run_metadata.SerializeToString())
      tf.logging.info('Wrote the RunMetadata of training step %d to %s',
                      self._trace_step, self._trace_path)
      # Its picture, Chrome trace and TensorBoard image (docs/schedules.md).
      timeline.WriteTrainerTimeline(run_metadata,
                                    os.path.dirname(self._trace_path),
                                    self._trace_step, self._model)
      return out
    self._WaitPrepared()
    if (self._prepared and feed_dict is None and options is None and
        run_metadata is None and self._prepared.Matches(fetches)):
      return self._prepared.Run()
    return super().run(fetches, feed_dict, options, run_metadata)


_NONFINITE = re.compile(r'not finite|NaN|Inf', re.IGNORECASE)
_GRADIENT_OF = re.compile(r'Gradient for (\S+?)(?::\d+)? is not finite')
# A step that can never run (jit_choice.CannotRunCause): Lingvo retries
# InvalidArgumentError as transient, so it would be retried for minutes, then
# end the job.
EXIT_STEP_CANNOT_RUN = 70  # EX_SOFTWARE


def CannotRunLine(job, error):
  """The one-line error for a step that can never run, else None."""
  cause = jit_choice.CannotRunCause(error)
  if not cause:
    return None
  if 'XLA_' in cause:
    fix = ('an XLA-compiled pipeline cell holds an op XLA cannot compile: '
           'build it without XLA (--jit_compile=False, or the pipeline\'s '
           'jit_compile:False)')
  else:
    fix = 'an op of the step has no kernel on its device'
  return f'{job}: the training step cannot run: {cause}; {fix}.'


class LocalTrainer(runner_state.RunnerMixin, lingvo_runners.Trainer):
  """Lingvo's Trainer; locally it polls for initialized variables.

  A step whose loss or gradients are not finite fails in Lingvo's
  CheckNumerics before any update; Lingvo retries it forever with back-off.
  Here it is retried at once, at most --max_nonfinite_steps times in a row.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    with self._graph.as_default(), tf.container(self._container_id):
      with self._cluster:
        self._finite_checks = checkpoints.FiniteChecks(tf.global_variables())
    self._nonfinite = {'step': None, 'count': 0}
    self._ahead = None
    self._keep_step = step_keeping.KeepTrainerStep(
        self._graph, self._options.job, self._options.distributed)
    self._progress = None
    if self.params.cluster.task == 0:
      self._progress = progress.Progress(self.params.train.max_steps)
    # Built here, not in the loop's thread: a controller may share the graph.
    with self._graph.as_default():
      self._uninitialized = tf.report_uninitialized_variables()

  @property
  def graph(self):
    return self._graph

  @property
  def finite_checks(self):
    """checkpoints.FiniteChecks of the global variables at the build."""
    return self._finite_checks

  @property
  def model(self):
    """The built model (one_build.SharedModelControllerMixin shares it)."""
    return self._model

  def PrepareAhead(self):
    """Opens its loop's session now and starts building the step in it.

    The runner manager calls it before creating a controller that shares
    the model (one_build.py): TensorFlow builds the step while the
    controller builds its checkpointer.
    """
    if self._CanPrepare():
      self._ahead = self._GetSession()
      self._ahead.PrepareStep(self._model.GetTask())

  def _CanPrepare(self):
    # Not across processes: a lost worker fails a callable's gRPC call with
    # a retried request's AbortedError, not Session.run's UnavailableError
    # that names the task (distributed/faults.py).
    return not self._options.distributed and len(self._model.tasks) == 1

  def _GetSession(self, **kwargs):
    model = getattr(self, '_model', None)
    if model is None:  # Lingvo's BaseRunner lists devices before the model.
      return super()._GetSession(**kwargs)
    ahead = getattr(self, '_ahead', None)
    if ahead is not None and not kwargs:  # Its loop's (PrepareAhead).
      self._ahead = None
      return ahead
    config = server.SessionConfig(self._options, **kwargs)
    o = self._options
    return self.NamingLostTasks(_TrainerSession(
        self._tf_master, graph=self._graph, config=config, model=model,
        on_step=self._OnStep if self._progress else None,
        trace_step=o.trace_train_step,
        summaries=self._run_state.train_summaries,
        step_lock=self._run_state.step_lock,
        trace_path=os.path.join(o.logdir, 'train',
                                f'run_metadata_step_{o.trace_train_step}.pb')))

  def _OnStep(self, global_step, metrics, run_s=None):
    self._keep_step.Ran(global_step)
    self._progress.Update(int(global_step), float(metrics['loss'][0]),
                          float(metrics['num_samples_in_batch'][0]))
    if self._run_state.plan_check:
      start = time.monotonic()
      self._run_state.plan_check.Ran(int(global_step), run_s)
      if time.monotonic() - start > 1:  # It waited for its prediction.
        self._progress.Restart()

  def _ShouldStop(self, sess=None, step=None, check_early_stop=True):
    if self._run_state.interrupted.is_set():
      self._DequeueThreadComplete()
      return True
    return super()._ShouldStop(sess, step, check_early_stop)

  def _DequeueThreadComplete(self):
    super()._DequeueThreadComplete()
    check = self._run_state.plan_check
    if check and not self._run_state.interrupted.is_set():
      check.Finish()  # A run that outlasted no prediction: checked at its end.
    self._run_state.trainer_done.set()

  def _RunLoop(self, job_name, loop_func, loop_args=(), cleanup_func=None):
    if job_name != 'trainer':
      return super()._RunLoop(job_name, loop_func, loop_args, cleanup_func)

    def LoopUntilFinite(*args):
      while True:
        try:
          return loop_func(*args)
        except tf.errors.InvalidArgumentError as e:
          line = CannotRunLine(job_name, e)
          if line:
            runner_state.Fail(line, EXIT_STEP_CANNOT_RUN)
          if not _NONFINITE.search(str(e)):
            raise
          self._OnNonFiniteStep(e)

    return super()._RunLoop(job_name, LoopUntilFinite, loop_args,
                            cleanup_func)

  def _OnNonFiniteStep(self, e):
    """Counts a failed step; stops the process at the limit."""
    with self._GetSession() as sess:
      step = int(sess.run(py_utils.GetGlobalStep())) + 1
      bad_vars = checkpoints.NonFiniteVariables(sess, self._finite_checks)
    state = self._nonfinite
    state['count'] = state['count'] + 1 if state['step'] == step else 1
    state['step'] = step
    limit = self._options.max_nonfinite_steps
    gradient = _GRADIENT_OF.search(str(e))
    if bad_vars:
      first = f'variable {bad_vars[0]}'
    elif gradient:
      first = f'the gradient of {gradient.group(1)} (the variables are finite)'
    else:
      first = f'{runner_state.FirstLine(e)} (the variables are finite)'
    # The user's layer, e.g. 'block3 (cell_005)', whatever the naming.
    layer = cuts.LayerOf(cuts.LayerLabels(self._model), first)
    layer = f'That variable is in layer {layer}. ' if layer else ''
    tf.logging.warning('Step %d is not finite (try %d of %d): %s. %s', step,
                       state['count'], limit, first, layer)
    if state['count'] < limit:
      return
    last = tf.train.latest_checkpoint(self._train_dir) or 'none'
    runner_state.Fail(
        f'training stopped at step {step}: its loss or gradients were NaN or '
        f'Inf in {state["count"]} tries (--max_nonfinite_steps='
        f'{limit}). First non-finite: {first}. Last good '
        f'checkpoint: {last}. {layer}Lower the learning rate (e.g. '
        "--model_params_override='task.train.learning_rate:1e-4') and run "
        'again to resume from it.', 3)

  def _WaitUntilInit(self, sess=None, start_up_delay_steps=None):
    if start_up_delay_steps:
      return super()._WaitUntilInit(sess, start_up_delay_steps)
    if self._CanPrepare() and isinstance(sess, _TrainerSession):
      # Built beside the controller's initialization and first save (unless
      # PrepareAhead started it).
      sess.PrepareStep(self._model.GetTask())
    # Lingvo sleeps a fixed 30 s so that the controller can initialize or
    # restore the variables first. That takes about a second: poll for it.
    uninitialized = self._uninitialized
    waiting, start = runner_state.Waiting(), time.time()
    while True:
      try:
        if not sess.run(uninitialized).size:
          break
      except tf.errors.FailedPreconditionError:
        pass  # Mid-restore; try again.
      if time.time() - start > 10:
        waiting.Say(
            'init', 'trainer: waiting for the controller to initialize or '
            'restore the variables; is --job=controller running? (Without '
            '--job, both run in this process.)')
      time.sleep(0.2)
    start = time.time()
    state = self._run_state
    # A restored run already has its checkpoint (the controller does not save
    # the restored step again).
    while (state.controller_here.is_set() and
           not state.first_save_done.wait(0.2) and
           not state.interrupted.is_set() and
           not tf.train.latest_checkpoint(self._train_dir)):
      if time.time() - start > 10:
        waiting.Say('first_save',
                    'trainer: waiting for the controller\'s first checkpoint.')
    global_step = sess.run(py_utils.GetGlobalStep())
    if self._options.distributed:
      global_step = self._keep_step.Keep(sess, global_step)
    self._SetStatusMessage('step:%6d' % global_step)
    return global_step
