r"""Trains or evaluates a registered lingvo_ext experiment with Lingvo's runners.

  python -m lingvo_ext.trainer --model=lm.TransformerLm --logdir=/tmp/lm
  tensorboard --logdir=/tmp/lm

This is `lingvo.trainer` (its RunnerManager, Controller, Trainer and Evaler,
and all of its flags) with lingvo_ext's experiments registered and these
changes:

- Defaults: --run_locally=cpu --mode=sync, so the jobs are
  controller,trainer_client in this process; checkpoints go to DIR/train,
  the trainer's summaries (loss, log_pplx, steps/sec...) to DIR/train, the
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
- An unknown --model prints the close registered names and exits with 2.
- A model with partitioned variables (a layer's `partitioner` set, e.g.
  lm.WordLmSharded) saves checkpoints with tf.train.Saver
  (--use_custom_saver=false unless given), whose saved slices restore into
  any other partitioning: lm.WordLm resumes from lm.WordLmSharded's logdir
  and back.
"""

import difflib
import os
import sys
import time

import lingvo_ext  # pylint: disable=unused-import,g-bad-import-order
from lingvo import runners
from lingvo import trainer as lingvo_trainer
from lingvo import model_registry
import lingvo.compat as tf
from lingvo.core import hyperparams
from lingvo.core import py_utils

# The experiments live in the top-level `params` package next to lingvo_ext.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.append(_ROOT)
import params  # pylint: disable=unused-import,g-import-not-at-top,g-bad-import-order
from lingvo_ext.tools import list_models  # pylint: disable=g-import-not-at-top,g-bad-import-order

FLAGS = tf.flags.FLAGS

tf.flags.DEFINE_integer(
    'num_cpu_devices', 1,
    'Logical CPU devices per replica (local runs). Use with '
    '--worker_split_size=N to pipeline a model over N CPU devices.')
tf.flags.DEFINE_integer(
    'max_steps', None, 'If set, overrides the experiment\'s train.max_steps.')

FLAGS.set_default('run_locally', 'cpu')
FLAGS.set_default('mode', 'sync')
FLAGS.set_default('stateless_vars_init', True)

# Jobs whose devices are listed from the session (cluster.ListDevices); each
# must expect as many CPUs as the session has.
_JOB_SPECS = ('controller', 'train_summaries', 'worker', 'ps', 'evaler',
              'decoder')


class _CpuDevicesMixin:
  """Gives a runner's sessions --num_cpu_devices CPU devices."""

  def _GetSession(self, **kwargs):
    # BaseRunner._GetSession with device_count; it matters for in-process
    # sessions (tf_master=''), e.g. an evaler running beside the trainer.
    config = py_utils.SessionConfig(**kwargs)
    config.device_count['CPU'] = FLAGS.num_cpu_devices
    return tf.Session(self._tf_master, graph=self._graph, config=config)


class LocalController(_CpuDevicesMixin, runners.Controller):
  pass


class LocalTrainer(_CpuDevicesMixin, runners.Trainer):
  """Lingvo's Trainer; locally it polls for initialized variables."""

  def _WaitUntilInit(self, sess=None, start_up_delay_steps=None):
    if not FLAGS.run_locally or start_up_delay_steps:
      return super()._WaitUntilInit(sess, start_up_delay_steps)
    # Lingvo sleeps a fixed 30 s so that a remote controller can initialize
    # or restore the variables first. In one process that takes about a
    # second: poll for it instead.
    with self._graph.as_default():
      uninitialized = tf.report_uninitialized_variables()
    while True:
      try:
        if not sess.run(uninitialized).size:
          break
      except tf.errors.FailedPreconditionError:
        pass  # Mid-restore; try again.
      time.sleep(0.2)
    global_step = sess.run(py_utils.GetGlobalStep())
    self._SetStatusMessage('step:%6d' % global_step)
    return global_step


class LocalEvaler(_CpuDevicesMixin, runners.Evaler):
  pass


class LocalDecoder(_CpuDevicesMixin, runners.Decoder):
  pass


class RunnerManager(lingvo_trainer.RunnerManager):
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

  def GetParamsForDataset(self, job_name, dataset_name):
    cfg = super().GetParamsForDataset(job_name, dataset_name)
    if FLAGS.max_steps is not None:
      cfg.train.max_steps = FLAGS.max_steps
      if 'task' in cfg:  # A single-task model keeps a copy in its task.
        cfg.task.train.max_steps = FLAGS.max_steps
    return cfg


def UnknownModelMessage(name):
  """The error for an unregistered --model, naming the close names."""
  names = list_models.RegisteredModels()
  close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
  # Also match on the class name alone (e.g. --model=TransformerLmTiny).
  close += [n for n in names if n.split('.')[-1].lower() == name.lower() and
            n not in close]
  msg = f'Unknown model {name!r}: it is not registered.'
  if close:
    msg += ' Did you mean:\n' + ''.join(f'  {n}\n' for n in close)
  else:
    msg += ' Registered models:\n' + ''.join(f'  {n}\n' for n in names)
  msg += 'List them all with: python -m lingvo_ext.tools.list_models'
  return msg


def _CheckFlags():
  """Returns an error message for bad flags, or None."""
  if not FLAGS.model:
    return ('--model is required, e.g. --model=lm.TransformerLmTiny; list '
            'the models with: python -m lingvo_ext.tools.list_models')
  if FLAGS.model not in list_models.RegisteredModels():
    return UnknownModelMessage(FLAGS.model)
  if FLAGS.mode in ('sync', 'async') and not FLAGS.logdir:
    return '--logdir is required, e.g. --logdir=/tmp/lingvo_ext/lm'
  if FLAGS.num_cpu_devices < 1:
    return f'--num_cpu_devices={FLAGS.num_cpu_devices} must be >= 1.'
  if FLAGS.max_steps is not None and FLAGS.max_steps < 0:
    return f'--max_steps={FLAGS.max_steps} must be >= 0.'
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


def main(unused_argv):
  lingvo_trainer.tpu_embedding_layers_v2.TPU_EMBEDDING_MANAGER = (
      lingvo_trainer.tpu_embedding_manager.TPUEmbeddingManager())
  RunnerManager(FLAGS.model).Start()


def Run(argv=None):
  """Parses flags, checks them, then runs Lingvo's trainer main."""
  argv = list(sys.argv if argv is None else argv)
  try:
    FLAGS(argv, known_only=True)
  except tf.flags.Error as e:
    print(f'{argv[0]}: {e}', file=sys.stderr)
    return 2
  error = _CheckFlags()
  if error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  _UseSlicedCheckpoints()
  if FLAGS.disable_tf2:
    tf.disable_v2_behavior()
  py_utils.SetEagerMode(FLAGS.use_eager)
  FLAGS.unparse_flags()
  tf.app.run(main, argv=argv)
  return 0


if __name__ == '__main__':
  sys.exit(Run())
