"""The trainer's runners: Lingvo's, through Lingvo's extension points.

`RunnerManager` is Lingvo's, with the trainer's registry (its
`model_registry`), N logical CPU devices per local replica and the
multi-process mode (distributed/trainer_lib.py). It owns the `RunState` its
runners share and hands them, with the trainer's `Options`, to the runner
classes it names (its Controller/Trainer/Evaler/Decoder attributes):

- `LocalController` shares the in-process trainer's graph and model where
  one runs beside it (one_build.py: one build of the model per process);
  it checkpoints through checkpoints.TrainingCheckpointer
  (returned from Lingvo's `_CreateCheckpointer`): finite saves only, the
  step kept when a task of a live cluster restarts; it saves the last
  checkpoint as soon as the trainer in its process stops, not up to 10 s
  later;
- `LocalTrainer` retries a non-finite step at once, at most
  --max_nonfinite_steps times; polls for the controller instead of sleeping
  30 s; its session (`_TrainerSession`) reports each step to the progress
  line and traces --trace_train_step;
- `LocalEvaler` / `LocalDecoder` stop after training's last checkpoint and
  print each result.
"""

import dataclasses
import fcntl
import functools
import os
import re
import sys
import threading
import time

from lingvo import runners as lingvo_runners
from lingvo import trainer as lingvo_trainer
import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np

from lingvo_ext import checkpoints
from lingvo_ext import one_build
from lingvo_ext import progress
from lingvo_ext import registry
from lingvo_ext import trainer_flags
from lingvo_ext._internal import process
from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.core import cuts
from lingvo_ext.distributed import faults
from lingvo_ext.distributed import server
from lingvo_ext.distributed import step_keeping
from lingvo_ext.distributed import trainer_lib
from lingvo_ext.tools import timeline

# Jobs whose devices are listed from the session (cluster.ListDevices); each
# must expect as many CPUs as the session has.
_JOB_SPECS = ('controller', 'train_summaries', 'worker', 'ps', 'evaler',
              'decoder')


@dataclasses.dataclass
class RunState:
  """What the runner threads of one trainer process tell each other.

  interrupted: set by the first SIGTERM, SIGHUP or Ctrl-C (shutdown.py): the
    trainer stops after its step, the controller saves a checkpoint and
    stops, evalers and decoders stop after the checkpoint they are on.
  stop_signal: the signal that set `interrupted`.
  final_save: the controller saved the step it stopped at.
  train_summaries: the controller's train summaries, run with a step of the
    trainer whose model it shares (one_build.py).
  controller_here: a controller runs in this process. In a new run its
    trainer waits for `first_save_done`, so that the first checkpoint holds
    the initial weights rather than whatever step the trainer reached.
  trainer_done: this process's trainer loop has ended (max_steps, Ctrl-C,
    early stop): the controller, which looks at the step every 10 s, looks
    at once and saves the last checkpoint.
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
  stop_signal: int = 0


def Fail(message, code):
  """Stops the whole process from a runner thread with a one-line error."""
  tf.logging.error(message)
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


class _RunnerMixin(faults.LostTaskReportMixin):
  """Takes the manager's state and options; N CPU devices per session."""

  def __init__(self, *args, run_state, options, **kwargs):
    self._run_state = run_state
    self._options = options
    super().__init__(*args, **kwargs)

  @property
  def stopped(self):
    """Whether its loop has finished (Lingvo's _DequeueThreadComplete)."""
    return self._dequeue_thread_complete

  def _GetSession(self, **kwargs):
    # BaseRunner._GetSession with device_count; it matters for in-process
    # sessions (tf_master=''), e.g. an evaler running beside the trainer.
    config = server.SessionConfig(self._options, **kwargs)
    return tf.Session(self._tf_master, graph=self._graph, config=config)

  def _CreateCheckpointer(self, train_dir, model, *args, **kwargs):
    # Restores a checkpoint of another cut of the pipeline too.
    return checkpoints.NewCheckpointer(
        train_dir, model,
        lambda: super(_RunnerMixin, self)._CreateCheckpointer(
            train_dir, model, *args, **kwargs))


class LocalController(_RunnerMixin, one_build.SharedModelControllerMixin,
                      lingvo_runners.Controller):
  """Lingvo's Controller; refuses to checkpoint non-finite variables.

  With `trainer=` (keyword), it shares that trainer's graph and model.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._woken = False
    if self._checkpointer is not None:
      self._run_state.controller_here.set()

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
        step_keeper=keeper)

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
    this process's trainer stops (RunState.trainer_done).
    """
    with tf.container(self._container_id), self._GetSession() as sess:
      if self._options.interactive:
        lingvo_runners.StartShell(locals())
        return
      # One run (Lingvo's two each prune the whole graph).
      sess.run([self._initialize_tables, self._initialize_local_vars])
      if not self.shares_model:  # Else the trainer's; initialised once.
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
        if self._ShouldStop(sess, global_step):
          tf.logging.info('Training finished.')
          if self._checkpoint_in_controller:
            self._checkpointer.Save(sess, global_step)
            if checkpoints.CheckpointStep(tf.train.latest_checkpoint(
                self._train_dir)) == int(global_step):
              self._run_state.final_save.set()
          sess.close()
          self._DequeueThreadComplete()
          return
        if self._checkpoint_in_controller:
          self._checkpointer.MaybeSave(sess, global_step)
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

  def WaitForNextLook(self, deadline):
    """Sleeps until `deadline` (time.time()) or until the trainer stops.

    Only the first wait after the trainer stopped is cut short: should the
    controller go on (its own stop rule not met), it looks every 10 s again.
    """
    if self._woken:
      time.sleep(max(0.0, deadline - time.time()))
    else:
      self._woken = self._run_state.trainer_done.wait(
          max(0.0, deadline - time.time()))

  def _DequeueThreadComplete(self):
    super()._DequeueThreadComplete()
    step = getattr(self, '_finished_step', None)
    if step is not None and self._checkpointer is not None:
      # After the last save: evalers and decoders stop at that checkpoint.
      checkpoints.MarkTrainingFinished(self._train_dir, step,
                                       self.params.train.max_steps)


class _TrainerSession(tf.Session):
  """The trainer's session: reports each training step; traces one.

  Lingvo's trainer loop runs [train_op, eval_metrics, per_example] and then
  fetches the global step; `on_step(global_step, eval_metrics)` is called
  then. The n-th train step (`trace_step`) runs with FULL_TRACE and its
  RunMetadata is written to `trace_path`. A step also fetches the train
  summaries a controller sharing the model asked for (`summaries`, a
  one_build.TrainSummaries), delivered with the global step after it.
  """

  def __init__(self, *args, model, on_step=None, trace_step=0,
               trace_path='', summaries=None, **kwargs):
    super().__init__(*args, **kwargs)
    self._model = model
    self._on_step = on_step
    self._summaries = summaries
    self._summary = None
    self._trace_step = trace_step
    self._trace_path = trace_path
    self._train_steps = 0
    self._metrics = None

  def _IsTrainStep(self, fetches):
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
          self._on_step(int(out), metrics)
        if self._summary is not None:
          summary, self._summary = self._summary, None
          self._summaries.Deliver(summary, int(out))
      return out
    summary_op = self._summaries.Fetch() if self._summaries else None
    if summary_op is not None:
      fetches = list(fetches) + [summary_op]
    out = self._RunTrainStep(fetches, feed_dict, options, run_metadata)
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
    return super().run(fetches, feed_dict, options, run_metadata)


_NONFINITE = re.compile(r'not finite|NaN|Inf', re.IGNORECASE)
_GRADIENT_OF = re.compile(r'Gradient for (\S+?)(?::\d+)? is not finite')


class LocalTrainer(_RunnerMixin, lingvo_runners.Trainer):
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
  def model(self):
    """The built model (one_build.SharedModelControllerMixin shares it)."""
    return self._model

  def _GetSession(self, **kwargs):
    model = getattr(self, '_model', None)
    if model is None:  # Lingvo's BaseRunner lists devices before the model.
      return super()._GetSession(**kwargs)
    config = server.SessionConfig(self._options, **kwargs)
    o = self._options
    return _TrainerSession(
        self._tf_master, graph=self._graph, config=config, model=model,
        on_step=self._OnStep if self._progress else None,
        trace_step=o.trace_train_step,
        summaries=self._run_state.train_summaries,
        trace_path=os.path.join(o.logdir, 'train',
                                f'run_metadata_step_{o.trace_train_step}.pb'))

  def _OnStep(self, global_step, metrics):
    self._keep_step.Ran(global_step)
    self._progress.Update(int(global_step), float(metrics['loss'][0]),
                          float(metrics['num_samples_in_batch'][0]))

  def _ShouldStop(self, sess=None, step=None, check_early_stop=True):
    if self._run_state.interrupted.is_set():
      self._DequeueThreadComplete()
      return True
    return super()._ShouldStop(sess, step, check_early_stop)

  def _DequeueThreadComplete(self):
    super()._DequeueThreadComplete()
    self._run_state.trainer_done.set()

  def _RunLoop(self, job_name, loop_func, loop_args=(), cleanup_func=None):
    if job_name != 'trainer':
      return super()._RunLoop(job_name, loop_func, loop_args, cleanup_func)

    def LoopUntilFinite(*args):
      while True:
        try:
          return loop_func(*args)
        except tf.errors.InvalidArgumentError as e:
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
      first = f'{FirstLine(e)} (the variables are finite)'
    # The user's layer, e.g. 'block3 (cell_005)', whatever the naming.
    layer = cuts.LayerOf(cuts.LayerLabels(self._model), first)
    layer = f'That variable is in layer {layer}. ' if layer else ''
    tf.logging.warning('Step %d is not finite (try %d of %d): %s. %s', step,
                       state['count'], limit, first, layer)
    if state['count'] < limit:
      return
    last = tf.train.latest_checkpoint(self._train_dir) or 'none'
    Fail(
        f'training stopped at step {step}: its loss or gradients were NaN or '
        f'Inf in {state["count"]} tries (--max_nonfinite_steps='
        f'{limit}). First non-finite: {first}. Last good '
        f'checkpoint: {last}. {layer}Lower the learning rate (e.g. '
        "--model_params_override='task.train.learning_rate:1e-4') and run "
        'again to resume from it.', 3)

  def _WaitUntilInit(self, sess=None, start_up_delay_steps=None):
    if start_up_delay_steps:
      return super()._WaitUntilInit(sess, start_up_delay_steps)
    # Lingvo sleeps a fixed 30 s so that the controller can initialize or
    # restore the variables first. That takes about a second: poll for it.
    uninitialized = self._uninitialized
    waiting, start = Waiting(), time.time()
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


# Seconds between two looks for a new checkpoint of an evaler or decoder.
CHECKPOINT_POLL_S = 1.0


class _WaitsForCheckpointsMixin:
  """An evaler or decoder that finishes, and says what it waits for.

  It processes the trainer's checkpoints as they come and stops after the
  last one once training has finished (the controller's `training_finished`
  file, see checkpoints.MarkTrainingFinished), whatever --max_steps the
  trainer ran with. Each result is printed on stdout.
  """

  def _Finished(self, path):
    """Whether training finished with checkpoint `path` as its last."""
    done = checkpoints.TrainingFinished(self._checkpointer.checkpoint_dir)
    step = checkpoints.CheckpointStep(path)
    return done is not None and step is not None and step >= done[0]

  def _TrainerFinished(self, sess=None):
    if self._OnceOnly():
      return False  # Evaluates the checkpoint, processed or not.
    train_dir = self._checkpointer.checkpoint_dir
    path = checkpoints.LatestCheckpoint(train_dir)
    if self._Finished(path):
      runner_dir = getattr(self, '_eval_dir', None) or getattr(
          self, '_decoder_dir', None)
      if runner_dir and path in py_utils.GetProcessedCheckpoints(runner_dir):
        print(f'{self._job_name}: training finished at '
              f'{os.path.basename(path)}, which was processed already (see '
              f'{runner_dir}); nothing to do.', flush=True)
      return True
    return super()._TrainerFinished(sess)

  def _Loop(self):
    try:
      super()._Loop()
    finally:
      self._DequeueThreadComplete()  # `stopped`: the manager waits for it.

  def _OnceOnly(self):
    o = self._options
    return o.eval_once or bool(o.eval_checkpoint)

  def _FindNewCheckpoint(self, sess=None, processed_ckpts=None):
    """The next checkpoint to process; None once training has finished."""
    if not hasattr(self, '_waiting'):
      self._waiting = Waiting()
    processed = processed_ckpts or ()
    train_dir = self._checkpointer.checkpoint_dir
    if self._OnceOnly():
      if getattr(self, '_evaluated_once', False):
        return None
      self._evaluated_once = True
      path = (self._options.eval_checkpoint or
              checkpoints.LatestCheckpoint(train_dir))
      if not path:
        print(f'{self._job_name}: --eval_once: no checkpoint in {train_dir}: '
              'nothing to evaluate.', file=sys.stderr, flush=True)
      return path
    while True:
      if self._run_state.interrupted.is_set():
        return None  # SIGTERM / Ctrl-C: between two checkpoints.
      if self._ShouldStop(sess, step=0):  # Lingvo's early stop.
        return None
      path = checkpoints.LatestCheckpoint(train_dir)
      if path and path not in processed:
        return path
      if self._Finished(path):
        return None
      if self._run_state.controller_here.is_set():
        pass  # Training runs in this process: nothing to tell.
      elif not path:
        self._waiting.Say(
            'none', f'{self._job_name}: waiting for a first checkpoint in '
            f'{train_dir}: train with the same --logdir (or add '
            f'{self._job_name} to the trainer\'s --job).')
      elif not TrainerRuns(os.path.dirname(train_dir)):
        self._waiting.Say(
            'gone', f'{self._job_name}: done with {path}; no trainer runs on '
            f'this logdir (nothing holds its {TRAINER_LOCK}): waiting for new '
            'checkpoints (--eval_once evaluates the newest and exits).',
            once=True)
      else:
        self._waiting.Say(
            path, f'{self._job_name}: done with {path}; waiting for a newer '
            f'checkpoint in {train_dir} (it stops after the last one of '
            'training).')
      time.sleep(CHECKPOINT_POLL_S)

  def _WriteSummaries(self, summary_writer, job_name, global_step, summaries,
                      text_filename=None):
    # The text file is written whole or not at all (a stop at the deadline
    # leaves no partial file under its final name).
    temp = text_filename and f'{text_filename}.tmp{os.getpid()}'
    super()._WriteSummaries(summary_writer, job_name, global_step, summaries,
                            temp)
    if temp and tf.io.gfile.exists(temp):
      tf.io.gfile.rename(temp, text_filename, overwrite=True)
    values = []
    for unused_name, summary in sorted(summaries.items()):
      for value in getattr(summary, 'value', ()):
        if value.HasField('simple_value'):
          values.append(f'{value.tag} {value.simple_value:.4g}')
    print(f'{self._job_name}: step {int(global_step)}  ' + '  '.join(values),
          flush=True)


class LocalEvaler(_RunnerMixin, _WaitsForCheckpointsMixin,
                  lingvo_runners.Evaler):
  pass


class LocalDecoder(_RunnerMixin, _WaitsForCheckpointsMixin,
                   lingvo_runners.Decoder):
  """Lingvo's Decoder; a task with no decoder metrics says so, once."""

  def DecodeCheckpoint(self, sess, checkpoint_path):
    if not self._task.CreateDecoderMetrics():
      if not getattr(self, '_said_no_decoder', False):
        self._said_no_decoder = True
        print(f'{self._job_name}: {self._task.params.name} '
              f'({type(self._task).__name__}) has no decoder (its '
              'CreateDecoderMetrics is empty): nothing to decode; '
              f'--job=evaler_{self._job_name.split("_")[-1]} evaluates its '
              'loss.', flush=True)
      return
    return super().DecodeCheckpoint(sess, checkpoint_path)


class RunnerManager(trainer_lib.DistributedRunnerManagerMixin,
                    lingvo_trainer.RunnerManager):
  """Lingvo's RunnerManager, with N logical CPU devices per replica.

  Args:
    model: The registered experiment's name.
    options: trainer_flags.Options; read from the flags when None.
    run_state: The RunState its runners share; a new one when None.
  """

  def __init__(self, model, options=None, run_state=None):
    super().__init__(model)
    self._options = options or trainer_flags.Options.FromFlags()
    self.run_state = run_state or RunState()
    self._share_model = False
    self._trainer_here = None
    # Lingvo's extension point for the registry: every runner's params come
    # from lingvo_ext's lookup, with the checked overrides.
    self.model_registry = registry.ModelRegistry(
        self._options.model_params_override,
        self._options.model_params_file_override,
        self._options.gpipe_engine)

  def _Runner(self, cls):
    return functools.partial(cls, run_state=self.run_state,
                             options=self._options)

  def _SharesModel(self, jobs):
    """Whether this process's controller shares its trainer's model."""
    return (not self._options.distributed and 'controller' in jobs and
            len(set(jobs)) == len(jobs) and
            bool({'trainer', 'trainer_client'} & set(jobs)))

  def CreateRunners(self, jobs, *args, **kwargs):
    """Lingvo's CreateRunners; a trainer here is built before the controller.

    The controller then takes the trainer's graph and model (one_build.py).
    """
    self._share_model = self._SharesModel(jobs)
    if not self._share_model:
      return super().CreateRunners(jobs, *args, **kwargs)
    order = sorted(jobs, key=lambda j: j not in ('trainer', 'trainer_client'))
    made = super().CreateRunners(order, *args, **kwargs)
    return [made[order.index(j)] for j in jobs]

  # pylint: disable=invalid-name
  @property
  def Controller(self):
    trainer = self._trainer_here
    if not (self._share_model and trainer and one_build.CanShare(
        trainer.model)):
      trainer = None
    return functools.partial(self._Runner(LocalController), trainer=trainer)

  @property
  def Trainer(self):
    def Make(*args, **kwargs):
      self._trainer_here = self._Runner(LocalTrainer)(*args, **kwargs)
      return self._trainer_here
    return Make

  @property
  def Evaler(self):
    return self._Runner(LocalEvaler)

  @property
  def Decoder(self):
    return self._Runner(LocalDecoder)

  # pylint: enable=invalid-name

  def MaybeConfigRunLocally(self):
    """Lingvo's local set-up, with a local server of N CPU devices."""
    if not self._options.run_locally:
      return
    config = server.SessionConfig(self._options, client=False)
    with internal_tf.LocalServerConfig(config):
      super().MaybeConfigRunLocally()

  def UpdateClusterParamsFromFlags(self, cluster, job_name):
    super().UpdateClusterParamsFromFlags(cluster, job_name)
    o = self._options
    if o.run_locally:
      for name in _JOB_SPECS:
        cluster.Get(name).cpus_per_replica = o.num_cpu_devices
      # Evaluate and decode with the trainer's splits: otherwise, with
      # --worker_split_size=N, they would run N one-device splits, each on
      # a full batch (N times the training batch).
      # The controller builds the training graph too: with the trainer's
      # splits it sees the trainer's replicas (not one per CPU device).
      for name in ('evaler', 'decoder', 'controller'):
        cluster.Get(name).devices_per_split = o.worker_split_size

  def StartRunners(self, all_runners):
    """Lingvo's StartRunners, after skipping damaged checkpoints.

    Returns once the runners finish, or, after a stop signal, once the
    controller has saved and the others stopped (an evaler or decoder after
    the checkpoint it is on).
    """
    o = self._options
    if o.logdir and ('controller' in o.jobs or 'trainer_client' in o.jobs):
      RepairCheckpoints(os.path.join(o.logdir, 'train'))
    runner = threading.Thread(
        target=super().StartRunners, args=(all_runners,), daemon=True)
    runner.start()
    waited = [r for r in all_runners if isinstance(r, _RunnerMixin)]
    while runner.is_alive():
      runner.join(0.5)
      # Each calls _DequeueThreadComplete when it stops (the controller
      # after its last checkpoint, an evaler after its checkpoint).
      if self.run_state.interrupted.is_set() and all(
          r.stopped for r in waited):
        break

  def GetParamsForDataset(self, job_name, dataset_name):
    cfg = super().GetParamsForDataset(job_name, dataset_name)
    if (self._share_model and job_name in ('trainer', 'trainer_client') and
        cfg.cluster.add_summary is None):
      # Lingvo's default adds summaries for the controller's build only; the
      # controller sharing this one fetches them with a step (one_build.py).
      cfg.cluster.add_summary = True
    if self._options.max_steps is not None:
      cfg.train.max_steps = self._options.max_steps
      if 'task' in cfg:  # A single-task model keeps a copy in its task.
        cfg.task.train.max_steps = self._options.max_steps
    return cfg


# Train dirs already repaired by this process: the repair runs before the
# runners (trainer.Run) and again where a RunnerManager is started directly.
_REPAIRED = {}


def RepairCheckpoints(train_dir):
  """Rebuilds a damaged state file, then skips damaged checkpoints.

  Returns:
    The checkpoint training resumes from, or None.
  """
  if train_dir in _REPAIRED:
    return _REPAIRED[train_dir]
  moved = checkpoints.LocalizeStateFile(train_dir)
  if moved:
    print(f'note: {moved}', file=sys.stderr, flush=True)
  problem = checkpoints.RebuildStateFile(train_dir)
  if problem:
    latest = tf.train.latest_checkpoint(train_dir)
    print(f'warning: {problem}; rebuilt it from the checkpoints on disk '
          f'(latest: {latest}).', file=sys.stderr, flush=True)
  path, skipped = checkpoints.FallBackToIntactCheckpoint(train_dir)
  for bad, why in skipped:
    print(f'warning: skipped damaged checkpoint {bad} (unreadable: {why}); '
          f'restoring {path or "nothing: starting afresh"}.',
          file=sys.stderr, flush=True)
  _REPAIRED[train_dir] = path
  return path
