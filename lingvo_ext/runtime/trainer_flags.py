"""The trainer's flags (beside Lingvo's), and the values it runs with.

Every flag lingvo_ext.trainer adds is defined here, so a new one is one
DEFINE and one `Options` field. The entry point (`trainer.Run`) parses the
flags once, sets the trainer's defaults for Lingvo's flags
(`SetTrainerDefaults`, never at import) and reads `Options.FromFlags()`;
the runners and lingvo_ext.distributed get those values, not FLAGS.
"""

import dataclasses
import os

import lingvo.compat as tf

from lingvo_ext.distributed import resolvers

FLAGS = tf.flags.FLAGS

tf.flags.DEFINE_integer(
    'num_cpu_devices', 1,
    'Logical CPU devices per replica (local runs). Use with '
    '--worker_split_size=N to pipeline a model over N CPU devices.')
tf.flags.DEFINE_integer(
    'intra_op_threads', None,
    'Threads of TensorFlow\'s intra-op pool, shared by the process\'s CPU '
    'devices. Default: the usable cores / --num_cpu_devices in a local run, '
    'else 0 (a thread per core). See docs/performance.md.')
tf.flags.DEFINE_integer(
    'max_steps', None, 'If set, overrides the experiment\'s train.max_steps.')
tf.flags.DEFINE_integer(
    'max_nonfinite_steps', 10,
    'Stop training (exit 3) after this many tries in a row of one step whose '
    'loss or gradients are NaN or Inf.')
tf.flags.DEFINE_float(
    'cluster_wait_secs', 120,
    'With --cluster_spec: how long a process waits for the other tasks of '
    'the cluster to answer before it exits with an error naming them.')
tf.flags.DEFINE_float(
    'worker_timeout_secs', 60,
    'With --cluster_spec: deadline of each session call (a step, a save); '
    'a call a lost task holds up fails after it, naming the task, and the '
    'process exits non-zero. See docs/clusters.md.')
tf.flags.DEFINE_enum(
    'cluster_resolver', None, list(resolvers.RESOLVERS),
    'Read the cluster, --job and --task from the environment instead of '
    '--cluster_spec: tf_config (TF_CONFIG) or slurm (SLURM_* of srun). See '
    'docs/clusters.md.')
tf.flags.DEFINE_integer(
    'slurm_port_base', 8888,
    'With --cluster_resolver=slurm: Slurm rank r serves port '
    'slurm_port_base + r.')
tf.flags.DEFINE_integer(
    'trace_train_step', 0,
    'If > 0, trace the N-th training step this process runs and write its '
    'RunMetadata to LOGDIR/train/run_metadata_step_N.pb. See '
    'docs/schedules.md.')

tf.flags.DEFINE_string(
    'plan', '', "'auto': choose the pipeline plan (cells, micro-batches, "
    'schedule, recompute, replicas) for --devices and --memory_per_device '
    'with lingvo_ext.tools.plan, log it and train with it.')
tf.flags.DEFINE_integer(
    'devices', None,
    '--plan=auto: devices to plan for (default: --num_cpu_devices).')
tf.flags.DEFINE_string(
    'memory_per_device', None,
    '--plan=auto: memory budget of each device, e.g. 512MB or 2GB.')
tf.flags.DEFINE_float(
    'shutdown_grace_secs', 20,
    'After SIGTERM, SIGHUP or Ctrl-C: seconds to save the current step and '
    'exit before exiting at once. Keep it below the cluster\'s grace period '
    '(Kubernetes: terminationGracePeriodSeconds, 30 s by default).')
tf.flags.DEFINE_integer(
    'preempted_exit_code', 0,
    'Exit status after SIGTERM/SIGHUP stopped a job safely, e.g. 75 for a '
    "Kubernetes Job's podFailurePolicy to restart it (docs/preemption.md).")
tf.flags.DEFINE_bool(
    'eval_once', False,
    'Evalers and decoders: evaluate the newest checkpoint once, print the '
    'metrics line and exit.')
tf.flags.DEFINE_string(
    'eval_checkpoint', '',
    'Evalers and decoders: evaluate this checkpoint (a prefix, e.g. '
    'LOGDIR/train/ckpt-00000100) once and exit.')
tf.flags.DEFINE_bool(
    'accept_changed_input', False,
    'Resume on training input files that changed since the logdir\'s first '
    'start without the warning, recording them as they are now (a changed '
    'vocab is still refused). See docs/faults.md.')
tf.flags.DEFINE_bool(
    'eval_one_pass', False,
    'With --eval_once or --eval_checkpoint: evalers and decoders score '
    'every example of the Dev/Test files once, in order. See '
    'docs/machine-translation.md.')
tf.flags.DEFINE_enum(
    'gpipe_engine', 'lingvo_ext', ['lingvo_ext', 'lingvo'],
    "The engine of Lingvo's GPipe layers in the experiment (lingvo.core.gpipe,"
    ' layers_with_gpipe, GPipeTransformerLm...): lingvo_ext (the default, '
    "runs off TPU) or lingvo. See docs/coming-from-lingvo.md.")
tf.flags.DEFINE_enum(
    'jit_compile', 'auto', ['auto', 'True', 'False'],
    "A local training run's XLA build of pipelines whose jit_compile is "
    "unset: 'auto' takes the faster (timed once per model and machine) for "
    'runs of --jit_auto_min_steps or more. See docs/performance.md.')
tf.flags.DEFINE_integer(
    'plan_check_steps', 50,
    "The 'plan check:' line (predicted against measured step and peak "
    'memory) after this many steps (0: no check). See docs/performance.md.')
tf.flags.DEFINE_float(
    'plan_check_secs', 30,
    "The 'plan check:' line no sooner than this many seconds of steps.")
tf.flags.DEFINE_integer(
    'jit_auto_min_steps', 10000,
    "--jit_compile=auto: the fewest steps to go for which the trainer "
    'times XLA against no XLA; shorter runs build without XLA.')

# The trainer's defaults for Lingvo's flags: one process runs the controller
# and the trainer client on CPU; variables start from name-seeded stateless
# initializers.
TRAINER_DEFAULTS = {
    'run_locally': 'cpu',
    'mode': 'sync',
    'stateless_vars_init': True,
}


def SetTrainerDefaults():
  """Sets TRAINER_DEFAULTS; the entry point calls it before parsing."""
  for name, value in TRAINER_DEFAULTS.items():
    FLAGS.set_default(name, value)


@dataclasses.dataclass(frozen=True)
class Options:
  """The flags the trainer's own code reads, read once at the entry point.

  Lingvo's runners keep reading Lingvo's flags (and its RunnerManager sets
  some, e.g. --job and --tf_master of a local run); lingvo_ext's code reads
  these values.
  """
  model: str = ''
  logdir: str = ''
  job: str = ''
  task: int = 0
  mode: str = 'sync'
  run_locally: str = ''
  cluster_spec: str = ''
  num_cpu_devices: int = 1
  intra_op_threads: int = None
  worker_gpus: int = 0
  worker_split_size: int = 1
  max_steps: int = None
  max_nonfinite_steps: int = 10
  cluster_wait_secs: float = 120
  worker_timeout_secs: float = 60
  trace_train_step: int = 0
  model_params_override: str = ''
  model_params_file_override: str = ''
  plan: str = ''
  devices: int = None
  memory_per_device: str = ''
  shutdown_grace_secs: float = 20
  preempted_exit_code: int = 0
  eval_once: bool = False
  eval_checkpoint: str = ''
  accept_changed_input: bool = False
  eval_one_pass: bool = False
  gpipe_engine: str = 'lingvo_ext'
  jit_compile: str = 'auto'
  jit_auto_min_steps: int = 10000
  plan_check_steps: int = 50
  plan_check_secs: float = 30
  # Lingvo's --interactive: the controller opens a shell instead of looping.
  interactive: bool = False
  # absl's --stderrthreshold as given; '' when not given (then a run that
  # logs to a file keeps only errors on stderr).
  stderrthreshold: str = dataclasses.field(default='',
                                           metadata={'flag': False})
  # Not a flag: set from the task's params at the entry point. False turns
  # Grappler's remapper off in every session config (precision.RemapperOff).
  grappler_remapping: bool = dataclasses.field(default=True,
                                               metadata={'flag': False})
  # Not a flag: the start-up memory check's warning line (printed on the
  # console by the check, written to the log once the log is the file's).
  start_warning: str = dataclasses.field(default='',
                                         metadata={'flag': False})

  @classmethod
  def FromFlags(cls):
    values = {f.name: FLAGS[f.name].value for f in dataclasses.fields(cls)
              if f.metadata.get('flag', True)}
    for name in ('model', 'logdir', 'job', 'run_locally', 'cluster_spec',
                 'model_params_override', 'model_params_file_override',
                 'plan', 'memory_per_device', 'eval_checkpoint'):
      values[name] = values[name] or ''
    values['worker_gpus'] = values['worker_gpus'] or 0
    if not FLAGS['stderrthreshold'].using_default_value:
      values['stderrthreshold'] = FLAGS.stderrthreshold
    return cls(**values)

  def IntraOpThreads(self, cores: int = None) -> int:
    """The intra-op pool's threads (0: TensorFlow's default).

    Args:
      cores: The cores this process may use (default: its CPU affinity).
    """
    if self.intra_op_threads is not None:
      return self.intra_op_threads
    # --plan=auto plans for --devices and then runs on as many.
    devices = (self.devices if self.plan and self.devices else
               self.num_cpu_devices)
    if self.run_locally != 'cpu' or devices <= 1:
      return 0
    if cores is None:
      cores = len(os.sched_getaffinity(0))
    return max(1, cores // devices)

  @property
  def distributed(self):
    """Whether this process is one task of a --cluster_spec cluster."""
    return bool(self.cluster_spec)

  @property
  def trains_here(self):
    """Whether this process runs the training (and writes checkpoints)."""
    if self.distributed:
      return 'controller' in self.jobs
    return 'controller' in self.jobs or 'trainer_client' in self.jobs

  @property
  def jobs(self):
    """This process's jobs; a local run's default as Lingvo sets it."""
    if self.job:
      return self.job.split(',')
    return (['controller', 'trainer'] if self.mode == 'async' else
            ['controller', 'trainer_client'])

  @property
  def devices_per_task(self):
    return self.worker_gpus or self.num_cpu_devices
