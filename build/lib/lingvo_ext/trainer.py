r"""Trains or evaluates a registered lingvo_ext experiment with Lingvo's runners.

  .venv/bin/python -m lingvo_ext.trainer --model=lm.TransformerLm --logdir=/tmp/lm
  .venv/bin/tensorboard --logdir=/tmp/lm

This is `lingvo.trainer` (its RunnerManager, Controller, Trainer and Evaler,
and all of its flags) with lingvo_ext's experiments registered and these
changes:

- Defaults: --run_locally=cpu --mode=sync, so the jobs are
  controller,trainer_client in this process; checkpoints go to DIR/train,
  the trainer's summaries (loss, log_pplx, global_step/sec...) to DIR/train, the
  controller's to DIR/control.
- --num_cpu_devices=N gives each local replica N logical CPU devices (the
  local server, the sessions and the cluster's job specs all get N), so
  --worker_split_size=N pipelines a model's cells across them. Stock
  lingvo.trainer always has one CPU device.
- --max_steps overrides the experiment's train.max_steps. Training resumes
  from the last checkpoint in DIR/train.
- Variables are initialized with stateless RNGs seeded by their names
  (--stateless_vars_init defaults to True), so runs are reproducible and do
  not depend on how a model is partitioned.
- --job=evaler_dev evaluates DIR/train's checkpoints on the dev split
  (summaries in DIR/eval_dev); add it to the training jobs
  (--job=controller,trainer_client,evaler_dev) to evaluate as training goes.
- An unknown --model prints the close registered names and exits with 2;
  --model=module.Class also finds an experiment module on PYTHONPATH (see
  lingvo_ext/registry.py).
- Failing safely: bad flags, an unusable --logdir and bad params are one
  line and exit 2. After --max_nonfinite_steps steps in a row whose loss or
  gradients are NaN/Inf, training stops (exit 3) naming the step, the first
  non-finite tensor and the last good checkpoint; no checkpoint holding
  NaN/Inf is written. A damaged latest checkpoint is skipped for the newest
  intact one (lingvo_ext/checkpoints.py). Ctrl-C saves a checkpoint, then
  exits with 130 (a second Ctrl-C exits at once).
- A model with partitioned variables (a layer's `partitioner` set, e.g.
  lm.WordLmSharded) saves checkpoints with tf.train.Saver
  (--use_custom_saver=false unless given), whose saved slices restore into
  any other partitioning: lm.WordLm resumes from lm.WordLmSharded's logdir
  and back.
"""

import fcntl
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback

import lingvo_ext  # pylint: disable=unused-import,g-bad-import-order
from lingvo import runners
from lingvo import trainer as lingvo_trainer
from lingvo import model_registry
import lingvo.compat as tf
from lingvo.core import hyperparams
from lingvo.core import py_utils

from lingvo_ext import checkpoints
from lingvo_ext import progress
from lingvo_ext import registry
from lingvo_ext.distributed import trainer_lib

FLAGS = tf.flags.FLAGS

tf.flags.DEFINE_integer(
    'num_cpu_devices', 1,
    'Logical CPU devices per replica (local runs). Use with '
    '--worker_split_size=N to pipeline a model over N CPU devices.')
tf.flags.DEFINE_integer(
    'max_steps', None, 'If set, overrides the experiment\'s train.max_steps.')
tf.flags.DEFINE_integer(
    'max_nonfinite_steps', 10,
    'Stop training (exit 3) after this many tries in a row of one step whose '
    'loss or gradients are NaN or Inf.')

FLAGS.set_default('run_locally', 'cpu')
FLAGS.set_default('mode', 'sync')
FLAGS.set_default('stateless_vars_init', True)

# Jobs whose devices are listed from the session (cluster.ListDevices); each
# must expect as many CPUs as the session has.
_JOB_SPECS = ('controller', 'train_summaries', 'worker', 'ps', 'evaler',
              'decoder')


class _CpuDevicesMixin(trainer_lib.LostTaskReportMixin):
  """Gives a runner's sessions --num_cpu_devices CPU devices."""

  def _GetSession(self, **kwargs):
    # BaseRunner._GetSession with device_count; it matters for in-process
    # sessions (tf_master=''), e.g. an evaler running beside the trainer.
    config = trainer_lib.SessionConfig(**kwargs)
    return trainer_lib.NewSession(self, self._tf_master, self._graph, config)

  def _CreateCheckpointer(self, train_dir, model, *args, **kwargs):
    ckpt = super()._CreateCheckpointer(train_dir, model, *args, **kwargs)
    # Its uninitialized-variables report is only run on a restore; a job that
    # ends without one (an evaler with nothing left to do) would print TF's
    # 'Object was never used' error when the tensor is collected.
    mark_used = getattr(getattr(ckpt, '_uninitialized_vars', None),
                        'mark_used', None)
    if mark_used:
      mark_used()
    return ckpt


# Set by the first Ctrl-C: the trainer stops after its step, the controller
# saves a checkpoint and stops.
_INTERRUPTED = threading.Event()
# Exit status the main thread returns once the runners are done.
_EXIT = {'code': 0, 'message': ''}
# Set once a controller in this process has made its first save attempt. In a
# new run its trainer waits for it, so the first checkpoint holds the initial
# weights rather than whatever step the trainer reached meanwhile.
_CONTROLLER_HERE = threading.Event()
_FIRST_SAVE_DONE = threading.Event()


def _Fail(message, code):
  """Stops the whole process from a runner thread with a one-line error."""
  tf.logging.error(message)
  tf.logging.flush()
  sys.stdout.flush()
  print(f'error: {message}', file=sys.stderr, flush=True)
  os._exit(code)  # pylint: disable=protected-access


def _FirstLine(e):
  return str(getattr(e, 'message', e)).strip().split('\n')[0]


class LocalController(_CpuDevicesMixin, runners.Controller):
  """Lingvo's Controller; refuses to checkpoint non-finite variables."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    if getattr(self, '_checkpointer', None) is None:
      return
    with self._graph.as_default(), tf.container(self._container_id):
      with self._cluster:
        self._finite_checks = checkpoints.FiniteChecks(tf.global_variables())
    save = self._checkpointer.Save

    def SaveIfFinite(sess=None, gsteps=None, sync=True):
      try:
        bad = checkpoints.NonFiniteVariables(sess, self._finite_checks)
        if bad:
          tf.logging.warning(
              'Not saving a checkpoint at step %s: variable %s (and %d more) '
              'holds NaN or Inf.', gsteps, bad[0], len(bad) - 1)
          return
        save(sess, gsteps, sync)
        if sync:
          dropped = checkpoints.DropLatestIfNonFinite(self._train_dir)
          if dropped:
            tf.logging.warning(
                'Removed checkpoint %s: %s became NaN or Inf while it was '
                'saved.', *dropped)
      finally:
        _FIRST_SAVE_DONE.set()

    self._checkpointer.Save = SaveIfFinite
    _CONTROLLER_HERE.set()
    if trainer_lib.IsDistributed():
      self._keep_step = trainer_lib.StepKeepingRestore(self)

  def _ShouldStop(self, sess=None, step=None, check_early_stop=True):
    if _INTERRUPTED.is_set():
      return True  # Lingvo's controller then saves a checkpoint.
    stop = super()._ShouldStop(sess, step, check_early_stop)
    if stop and step is not None and step >= self.params.train.max_steps:
      self._finished_step = int(step)  # Its checkpoint is saved next.
    return stop

  def _DequeueThreadComplete(self):
    super()._DequeueThreadComplete()
    step = getattr(self, '_finished_step', None)
    if step is not None and getattr(self, '_checkpointer', None) is not None:
      # After the last save: evalers and decoders stop at that checkpoint.
      checkpoints.MarkTrainingFinished(self._train_dir, step,
                                       self.params.train.max_steps)


_NONFINITE = re.compile(r'not finite|NaN|Inf', re.IGNORECASE)
_GRADIENT_OF = re.compile(r'Gradient for (\S+?)(?::\d+)? is not finite')


class LocalTrainer(_CpuDevicesMixin, runners.Trainer):
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
    self._keep_step = trainer_lib.KeepTrainerStep(self)
    if self.params.cluster.task == 0:
      self._progress = progress.Progress(self.params.train.max_steps)
      process = self._model.ProcessFPropResults

      def ProcessFPropResults(sess, global_step, metrics, per_example):
        self._keep_step.Ran(global_step)
        self._progress.Update(int(global_step), float(metrics['loss'][0]),
                              float(metrics['num_samples_in_batch'][0]))
        return process(sess, global_step, metrics, per_example)

      self._model.ProcessFPropResults = ProcessFPropResults

  def _ShouldStop(self, sess=None, step=None, check_early_stop=True):
    if _INTERRUPTED.is_set():
      self._DequeueThreadComplete()
      return True
    return super()._ShouldStop(sess, step, check_early_stop)

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
    gradient = _GRADIENT_OF.search(str(e))
    if bad_vars:
      first = f'variable {bad_vars[0]}'
    elif gradient:
      first = f'the gradient of {gradient.group(1)} (the variables are finite)'
    else:
      first = f'{_FirstLine(e)} (the variables are finite)'
    tf.logging.warning('Step %d is not finite (try %d of %d): %s', step,
                       state['count'], FLAGS.max_nonfinite_steps, first)
    if state['count'] < FLAGS.max_nonfinite_steps:
      return
    last = tf.train.latest_checkpoint(self._train_dir) or 'none'
    _Fail(
        f'training stopped at step {step}: its loss or gradients were NaN or '
        f'Inf in {state["count"]} tries (--max_nonfinite_steps='
        f'{FLAGS.max_nonfinite_steps}). First non-finite: {first}. Last good '
        f'checkpoint: {last}. Lower the learning rate (e.g. '
        "--model_params_override='task.train.learning_rate:1e-4') and run "
        'again to resume from it.', 3)

  def _WaitUntilInit(self, sess=None, start_up_delay_steps=None):
    if start_up_delay_steps:
      return super()._WaitUntilInit(sess, start_up_delay_steps)
    # Lingvo sleeps a fixed 30 s so that the controller can initialize or
    # restore the variables first. That takes about a second: poll for it.
    with self._graph.as_default():
      uninitialized = tf.report_uninitialized_variables()
    waiting, start = _Waiting(), time.time()
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
    # A restored run already has its checkpoint (the controller does not save
    # the restored step again).
    while (_CONTROLLER_HERE.is_set() and not _FIRST_SAVE_DONE.wait(0.2) and
           not _INTERRUPTED.is_set() and
           not tf.train.latest_checkpoint(self._train_dir)):
      if time.time() - start > 10:
        waiting.Say('first_save',
                    'trainer: waiting for the controller\'s first checkpoint.')
    global_step = sess.run(py_utils.GetGlobalStep())
    if trainer_lib.IsDistributed():
      global_step = self._keep_step.Keep(sess, global_step)
    self._SetStatusMessage('step:%6d' % global_step)
    return global_step


# Seconds between two "waiting for ..." lines of a job that waits.
WAIT_MESSAGE_INTERVAL_S = 30.0


class _Waiting:
  """Says on stderr what a job waits for: at once, then now and then."""

  def __init__(self):
    self._last = {}

  def Say(self, key, message):
    now = time.time()
    if now - self._last.get(key, -1e9) >= WAIT_MESSAGE_INTERVAL_S:
      self._last[key] = now
      print(message, file=sys.stderr, flush=True)
      tf.logging.info('%s', message)


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
    train_dir = self._checkpointer.checkpoint_dir
    path = tf.train.latest_checkpoint(train_dir)
    if self._Finished(path):
      runner_dir = getattr(self, '_eval_dir', None) or getattr(
          self, '_decoder_dir', None)
      if runner_dir and path in py_utils.GetProcessedCheckpoints(runner_dir):
        print(f'{self._job_name}: training finished at '
              f'{os.path.basename(path)}, which was processed already (see '
              f'{runner_dir}); nothing to do.', flush=True)
      return True
    return super()._TrainerFinished(sess)

  def _FindNewCheckpoint(self, sess=None, processed_ckpts=None):
    """The next checkpoint to process; None once training has finished."""
    if not hasattr(self, '_waiting'):
      self._waiting = _Waiting()
    processed = processed_ckpts or ()
    train_dir = self._checkpointer.checkpoint_dir
    while True:
      if self._ShouldStop(sess, step=0):  # Lingvo's early stop.
        return None
      path = tf.train.latest_checkpoint(train_dir)
      if path and path not in processed:
        return path
      if self._Finished(path):
        return None
      if not path:
        self._waiting.Say(
            'none', f'{self._job_name}: waiting for a first checkpoint in '
            f'{train_dir}: train with the same --logdir (or add '
            f'{self._job_name} to the trainer\'s --job).')
      else:
        self._waiting.Say(
            path, f'{self._job_name}: done with {path}; waiting for a newer '
            f'checkpoint in {train_dir} (it stops after the last one of '
            'training).')
      time.sleep(CHECKPOINT_POLL_S)

  def _WriteSummaries(self, summary_writer, job_name, global_step, summaries,
                      text_filename=None):
    super()._WriteSummaries(summary_writer, job_name, global_step, summaries,
                            text_filename)
    values = []
    for name, summary in sorted(summaries.items()):
      for value in getattr(summary, 'value', ()):
        if value.HasField('simple_value'):
          values.append(f'{value.tag} {value.simple_value:.4g}')
    print(f'{self._job_name}: step {int(global_step)}  ' + '  '.join(values),
          flush=True)


class LocalEvaler(_CpuDevicesMixin, _WaitsForCheckpointsMixin,
                  runners.Evaler):
  pass


class LocalDecoder(_CpuDevicesMixin, _WaitsForCheckpointsMixin,
                   runners.Decoder):
  pass


class RunnerManager(trainer_lib.DistributedRunnerManagerMixin,
                    lingvo_trainer.RunnerManager):
  """Lingvo's RunnerManager, with N logical CPU devices per replica."""

  # pylint: disable=invalid-name
  Controller = LocalController

  @property
  def Trainer(self):
    return LocalTrainer

  @property
  def Evaler(self):
    return LocalEvaler

  @property
  def Decoder(self):
    return LocalDecoder

  # pylint: enable=invalid-name

  def MaybeConfigRunLocally(self):
    """Lingvo's local set-up, with a local server of N CPU devices."""
    if not FLAGS.run_locally:
      return
    # Lingvo makes the in-process server with create_local_server(); its
    # devices come from the server's config, not the sessions'.
    server_cls = tf.distribute.Server
    original = server_cls.__dict__['create_local_server']
    config = py_utils.SessionConfig()
    config.device_count['CPU'] = FLAGS.num_cpu_devices

    def CreateLocalServer(config=config, start=True):
      return original.__func__(config=config, start=start)

    server_cls.create_local_server = staticmethod(CreateLocalServer)
    try:
      super().MaybeConfigRunLocally()
    finally:
      server_cls.create_local_server = original

  def UpdateClusterParamsFromFlags(self, cluster, job_name):
    super().UpdateClusterParamsFromFlags(cluster, job_name)
    if FLAGS.run_locally:
      for name in _JOB_SPECS:
        cluster.Get(name).cpus_per_replica = FLAGS.num_cpu_devices
      # Evaluate and decode with the trainer's splits: otherwise, with
      # --worker_split_size=N, they would run N one-device splits, each on
      # a full batch (N times the training batch).
      # The controller builds the training graph too: with the trainer's
      # splits it sees the trainer's replicas (not one per CPU device).
      for name in ('evaler', 'decoder', 'controller'):
        cluster.Get(name).devices_per_split = FLAGS.worker_split_size

  def StartRunners(self, all_runners):
    """Lingvo's StartRunners, after skipping damaged checkpoints.

    Returns once the runners finish, or, after Ctrl-C, once the controller
    and trainer have (an evaler would wait for checkpoints forever).
    """
    jobs = FLAGS.job.split(',')
    if FLAGS.logdir and ('controller' in jobs or 'trainer_client' in jobs):
      _RepairCheckpoints(os.path.join(FLAGS.logdir, 'train'))
    runner = threading.Thread(
        target=super().StartRunners, args=(all_runners,), daemon=True)
    runner.start()
    training = [
        r for r in all_runners
        if isinstance(r, (runners.Controller, runners.Trainer))
    ]
    while runner.is_alive():
      runner.join(0.5)
      # Both set _dequeue_thread_complete when they stop (the controller
      # after its last checkpoint).
      if _INTERRUPTED.is_set() and all(
          getattr(r, '_dequeue_thread_complete', False) for r in training):
        break

  def GetParamsForDataset(self, job_name, dataset_name):
    cfg = super().GetParamsForDataset(job_name, dataset_name)
    if FLAGS.max_steps is not None:
      cfg.train.max_steps = FLAGS.max_steps
      if 'task' in cfg:  # A single-task model keeps a copy in its task.
        cfg.task.train.max_steps = FLAGS.max_steps
    return cfg


def _RepairCheckpoints(train_dir):
  """Rebuilds a damaged state file, then skips damaged checkpoints.

  Returns:
    The checkpoint training resumes from, or None.
  """
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
  return path


# The lock a training process holds on its logdir for its whole life (the
# kernel drops it when the process ends, however it ends).
LOCK_FILE = 'trainer.lock'
_LOCK = {}


def _LockLogdir(logdir):
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


def _TrainsHere():
  """Whether this process runs the training (and writes checkpoints)."""
  jobs = (FLAGS.job or 'controller,trainer_client').split(',')
  if FLAGS.cluster_spec:
    return 'controller' in jobs
  return 'controller' in jobs or 'trainer_client' in jobs


def _CheckParams():
  """Applies the overrides to the experiment's params; an error or None."""
  from lingvo_ext.tasks import pipelined_task  # pylint: disable=g-import-not-at-top
  try:
    cfg = model_registry.GetParams(FLAGS.model, 'Train')
    task = cfg.task if 'task' in cfg else None
    if task is not None and issubclass(task.cls, pipelined_task.PipelinedTask):
      task.cls.CheckParams(task)
      batch = (cfg.input.batch_size if 'input' in cfg and cfg.input is not None
               and 'batch_size' in cfg.input else None)
      if batch and batch % task.num_micro_batches:
        return (f'{task.name}: input.batch_size={batch} is not divisible by '
                f'task.num_micro_batches={task.num_micro_batches}; set '
                'task.input.batch_size to a multiple of it, or another '
                'task.num_micro_batches.')
    _UseSlicedCheckpoints()
  except (ValueError, AttributeError, LookupError) as e:
    return _FirstLine(e)
  return None


def _AlreadyTrained():
  """The 'nothing to do' line of a finished logdir, or None."""
  train_dir = os.path.join(FLAGS.logdir, 'train')
  path = _RepairCheckpoints(train_dir)
  step = checkpoints.CheckpointStep(path)
  max_steps = FLAGS.max_steps
  if max_steps is None:
    max_steps = model_registry.GetParams(FLAGS.model, 'Train').train.max_steps
  if step is None or step < max_steps:
    checkpoints.ClearTrainingFinished(train_dir)
    return None
  checkpoints.MarkTrainingFinished(train_dir, step, max_steps)
  return (f'already trained to step {step} (max_steps {max_steps}): nothing '
          'to do; raise --max_steps to go on.')


def _CheckLogdir(logdir):
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


def _CheckFlags():
  """Returns an error message for bad flags, or None."""
  if not FLAGS.model:
    return ('--model is required, e.g. --model=lm.TransformerLmTiny; list '
            'the models with: .venv/bin/python -m lingvo_ext.tools.list_models')
  error = registry.CheckModel(FLAGS.model)
  if error:
    return error
  if FLAGS.mode in ('sync', 'async') and not FLAGS.logdir:
    return '--logdir is required, e.g. --logdir=/tmp/lingvo_ext/lm'
  if FLAGS.num_cpu_devices < 1:
    return f'--num_cpu_devices={FLAGS.num_cpu_devices} must be >= 1.'
  if FLAGS.max_steps is not None and FLAGS.max_steps < 0:
    return f'--max_steps={FLAGS.max_steps} must be >= 0.'
  if FLAGS.cluster_spec:
    return trainer_lib.CheckFlags()
  if FLAGS.run_locally == 'cpu':
    n, split = FLAGS.num_cpu_devices, FLAGS.worker_split_size
    if split < 1 or n % split:
      return (f'--worker_split_size={split} must divide '
              f'--num_cpu_devices={n}; to pipeline over {split} CPU devices '
              f'pass --num_cpu_devices={split}.')
  return None


def _HasPartitioner(p):
  """Whether params p, or any nested in it, set a `partitioner`."""
  if isinstance(p, (list, tuple)):
    return any(_HasPartitioner(x) for x in p)
  if not isinstance(p, hyperparams.Params):
    return False
  for name, value in p.IterParams():
    if name == 'partitioner' and value is not None:
      return True
    if _HasPartitioner(value):
      return True
  return False


def _UseSlicedCheckpoints():
  """TF's Saver for models with partitioned variables.

  Lingvo's own saver writes each shard under its own name; tf.train.Saver
  writes a partitioned variable as one tensor in saved slices, which restores
  into any other partitioning. An explicit --use_custom_saver wins.
  """
  if FLAGS['use_custom_saver'].present:
    return
  if _HasPartitioner(model_registry.GetParams(FLAGS.model, 'Train')):
    FLAGS.set_default('use_custom_saver', False)


def _OnSigint(unused_signum, unused_frame):
  if _INTERRUPTED.is_set():
    print('\ninterrupted again: exiting without a checkpoint.',
          file=sys.stderr, flush=True)
    os._exit(130)  # pylint: disable=protected-access
  _INTERRUPTED.set()
  print('\ninterrupted: saving a checkpoint, then exiting (Ctrl-C again to '
        'exit at once).', file=sys.stderr, flush=True)


def main(unused_argv):
  registry.Install()
  lingvo_trainer.tpu_embedding_layers_v2.TPU_EMBEDDING_MANAGER = (
      lingvo_trainer.tpu_embedding_manager.TPUEmbeddingManager())
  signal.signal(signal.SIGINT, _OnSigint)
  if FLAGS.run_locally == 'cpu' and FLAGS.num_cpu_devices > 1:
    splits = FLAGS.num_cpu_devices // FLAGS.worker_split_size
    if splits > 1:
      print(f'note: --num_cpu_devices={FLAGS.num_cpu_devices} with '
            f'--worker_split_size={FLAGS.worker_split_size} runs {splits} '
            'data-parallel splits, each on a full input batch_size; pass '
            f'--worker_split_size={FLAGS.num_cpu_devices} to pipeline the '
            f'model over the {FLAGS.num_cpu_devices} devices instead.',
            flush=True)
  if FLAGS.logdir and not FLAGS.logtostderr:
    job = FLAGS.job or 'controller,trainer_client'
    log_file = progress.LogFilePath(FLAGS.logdir, job)
    print(f'lingvo_ext.trainer: --model={FLAGS.model} --job={job}; '
          f'the full log is in {log_file} (--alsologtostderr to print it '
          'here too).', flush=True)
    progress.RouteLogToFile(log_file)
  try:
    RunnerManager(FLAGS.model).Start()
  except ValueError as e:  # Bad params, found while building the model.
    tf.logging.vlog(1, '%s', traceback.format_exc())
    print(f'error: {e}', file=sys.stderr, flush=True)
    return 2
  if _INTERRUPTED.is_set():
    last = tf.train.latest_checkpoint(os.path.join(FLAGS.logdir, 'train'))
    print(f'interrupted: the last checkpoint is {last}; run the same command '
          'to resume from it.', file=sys.stderr, flush=True)
    return 130
  return 0


# The flags --help describes; --helpfull lists all of Lingvo's and TF's.
_HELP_FLAGS = ('model', 'logdir', 'max_steps', 'num_cpu_devices',
               'worker_split_size', 'job', 'model_params_override',
               'max_nonfinite_steps')


def _Help(full):
  if full:
    return FLAGS.get_help()
  lines = [__doc__.strip(), '', 'Flags (--helpfull lists all of them):']
  for name in _HELP_FLAGS:
    flag = FLAGS[name]
    lines.append(f'  --{name}: {flag.help} (default: {flag.default!r})')
  return '\n'.join(lines)


def Run(argv=None):
  """Parses flags, checks them, then runs Lingvo's trainer main."""
  argv = list(sys.argv if argv is None else argv)
  for arg in argv[1:]:
    if arg in ('-h', '--help', '-?', '--helpshort', '--helpfull'):
      print(_Help(full=arg == '--helpfull'))
      return 0
  try:
    FLAGS(argv)
  except tf.flags.Error as e:
    message = ' '.join(str(e).split())
    print(f'error: {message} (--help lists the flags)', file=sys.stderr)
    return 2
  if FLAGS.cluster_spec:  # One task of a cluster (lingvo_ext.distributed).
    FLAGS.set_default('run_locally', '')
  # Everything checked before anything is written to the logdir.
  error = _CheckFlags()
  if not error:
    registry.Install()
    error = _CheckParams()
  if not error and FLAGS.logdir:
    error = _CheckLogdir(FLAGS.logdir)
  local = FLAGS.logdir and '://' not in FLAGS.logdir
  if not error and local and _TrainsHere():
    error = _LockLogdir(FLAGS.logdir)
  if error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  if local and _TrainsHere() and not FLAGS.cluster_spec:
    done = _AlreadyTrained()
    if done:
      print(done, flush=True)
      return 0
  if FLAGS.disable_tf2:
    tf.disable_v2_behavior()
  py_utils.SetEagerMode(FLAGS.use_eager)
  FLAGS.unparse_flags()
  tf.app.run(main, argv=argv)
  return 0


if __name__ == '__main__':
  sys.exit(Run())
