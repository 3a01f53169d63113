"""The trainer's multi-process mode: Lingvo's --cluster_spec, checked and mapped.

`lingvo_ext.trainer` mixes `DistributedRunnerManagerMixin` into its
RunnerManager. With --cluster_spec (which turns --run_locally off) each
process is one task of a TensorFlow cluster; Lingvo's runners, TensorFlow's
gRPC servers and its sessions do the rest. On top of Lingvo this adds:

- model splits that span processes (`cluster.WorkerLayout`): with one CPU
  per worker, --worker_split_size=K puts cell i of replica r on worker task
  r*K+i;
- one-line errors for a cluster spec that lacks a job, a split larger than
  the workers' devices, a taken port, and addresses that never answer
  (--cluster_wait_secs);
- a deadline on every session call (--worker_timeout_secs), so a client
  whose worker vanished reports it instead of hanging.
"""

import os
import re
import sys

import lingvo.compat as tf
from lingvo.core import py_utils

from lingvo_ext.distributed import cluster

FLAGS = tf.flags.FLAGS

tf.flags.DEFINE_float(
    'cluster_wait_secs', 120,
    'With --cluster_spec: how long a process waits for the other tasks of '
    'the cluster to answer before it exits with an error naming them.')
tf.flags.DEFINE_float(
    'worker_timeout_secs', 60,
    'With --cluster_spec: deadline of each session call (a training step, '
    'a checkpoint save). A call that a dead or unreachable task keeps from '
    'finishing fails after this long, naming the task, instead of hanging; '
    'the process then exits non-zero (lingvo_ext.launch restarts it).')


def IsDistributed():
  return bool(FLAGS.cluster_spec)


def DevicesPerTask():
  return FLAGS.worker_gpus or FLAGS.num_cpu_devices


def CheckFlags():
  """Returns an error message for bad multi-process flags, or None."""
  if not IsDistributed():
    return None
  try:
    jobs = cluster.ParseClusterSpec(FLAGS.cluster_spec)
    if not FLAGS.job:
      return ('--job is required with --cluster_spec, e.g. --job=worker '
              '--task=0 (or controller, trainer_client).')
    cluster.CheckClusterFlags(jobs, FLAGS.mode, FLAGS.job.split(','),
                              FLAGS.task)
    if FLAGS.mode == 'sync':
      layout = cluster.MakeWorkerLayout(
          len(jobs['worker']), DevicesPerTask(), FLAGS.worker_split_size)
      if (FLAGS['worker_replicas'].present and
          FLAGS.worker_replicas != layout.num_replicas):
        return (f'--worker_replicas={FLAGS.worker_replicas} disagrees with '
                f'--cluster_spec: {len(jobs["worker"])} worker task(s) x '
                f'{DevicesPerTask()} device(s) / --worker_split_size='
                f'{FLAGS.worker_split_size} make {layout.num_replicas} '
                'replica(s); drop --worker_replicas or change the worker '
                'count.')
  except ValueError as e:
    return str(e)
  if FLAGS.cluster_wait_secs <= 0 or FLAGS.worker_timeout_secs <= 0:
    return '--cluster_wait_secs and --worker_timeout_secs must be > 0.'
  return None


def SessionConfig(client=True, **kwargs):
  """Lingvo's session config with this run's devices and step deadline.

  Args:
    client: For a client's sessions (not a server's default config): they
      see only the worker and ps jobs and their own, so a session does not
      wait for the other clients (TensorFlow's master waits for every task
      it may place ops on before it creates a session).
    **kwargs: Passed to `py_utils.SessionConfig`.
  """
  config = py_utils.SessionConfig(**kwargs)
  config.device_count['CPU'] = FLAGS.num_cpu_devices
  if IsDistributed():
    config.operation_timeout_in_ms = int(FLAGS.worker_timeout_secs * 1000)
    if client:
      own = FLAGS.job.split(',')[0]
      config.device_filters.extend(
          sorted({'/job:worker', '/job:ps', f'/job:{own}'}))
  return config


_SERVER_JOBS = ('worker', 'ps', 'input', 'trainer')


def _Exit(message):
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(2)


class DistributedRunnerManagerMixin:
  """RunnerManager methods for --cluster_spec runs (see module doc)."""

  def MaybeConfigRunDistributed(self):
    super().MaybeConfigRunDistributed()
    if not IsDistributed() or FLAGS.mode != 'sync':
      return
    jobs = cluster.ParseClusterSpec(FLAGS.cluster_spec)
    layout = cluster.MakeWorkerLayout(
        len(jobs['worker']), DevicesPerTask(), FLAGS.worker_split_size)
    # Lingvo made each worker task a replica; replicas are splits instead.
    FLAGS.worker_replicas = layout.num_replicas
    tf.logging.info(
        'Cluster layout: %d worker task(s) x %d device(s), %d replica(s) of '
        '%d cell device(s): %s', layout.num_tasks, layout.devices_per_task,
        layout.num_replicas, layout.split_size, '; '.join(
            f'replica {r} cell {i} on {layout.Device(r, i)}'
            for r in range(layout.num_replicas)
            for i in range(layout.split_size)))

  def UpdateClusterParamsFromFlags(self, cluster_p, job_name):
    super().UpdateClusterParamsFromFlags(cluster_p, job_name)
    if not IsDistributed() or FLAGS.mode != 'sync':
      return
    jobs = cluster.ParseClusterSpec(FLAGS.cluster_spec)
    layout = cluster.MakeWorkerLayout(
        len(jobs['worker']), DevicesPerTask(), FLAGS.worker_split_size)
    cluster.UpdateClusterParams(cluster_p, layout, jobs, FLAGS.num_cpu_devices,
                                FLAGS.job.split(',')[0])

  def MaybeLaunchTensorFlow(self):
    """Starts this task's server; clients wait for the others to answer."""
    if not IsDistributed():
      return super().MaybeLaunchTensorFlow()
    jobs = cluster.ParseClusterSpec(FLAGS.cluster_spec)
    job = FLAGS.job.split(',')[0]
    me = f'{job} task {FLAGS.task}'
    address = jobs[job][FLAGS.task]
    try:
      cluster.CheckPortFree(address, me)
      self._tf_server = tf.distribute.Server(
          tf.train.ClusterSpec(jobs),
          job_name=job,
          task_index=FLAGS.task,
          config=SessionConfig(client=False))
    except ValueError as e:
      _Exit(str(e))
    except tf.errors.OpError as e:
      _Exit(f'{me} could not serve {address} (--cluster_spec): {e.message}; '
            'is the port in use, or the host not this machine?')
    print(f'{me} serving on {address}', file=sys.stderr, flush=True)
    if not FLAGS.tf_master:
      FLAGS.tf_master = self._tf_server.target
    if job in ('worker', 'ps', 'input'):
      return  # Servers only; the clients drive them.
    # Clients need the servers that hold the variables and run the ops, not
    # each other (a restarted controller may find training already done).
    others = {
        f'{j} task {t}': a for j, addrs in jobs.items() if j in _SERVER_JOBS
        for t, a in enumerate(addrs) if a != address
    }
    try:
      cluster.WaitForAddresses(others, FLAGS.cluster_wait_secs)
    except TimeoutError as e:
      _Exit(f'{me}: {e}')
    tf.logging.info('All %d other task(s) answer.', len(others))


tf.flags.DEFINE_integer(
    'trace_train_step', 0,
    'If > 0, the trainer traces the N-th training step this process runs '
    '(the global step N when training starts from scratch) with '
    'RunOptions.FULL_TRACE and writes its RunMetadata (step stats: the device '
    'of every op that ran) to LOGDIR/train/run_metadata_step_N.pb.')


class _TracingSession(tf.Session):
  """A session that traces the N-th run of the trainer's train op."""

  def __init__(self, *args, runner, **kwargs):
    super().__init__(*args, **kwargs)
    self._runner = runner
    self._train_steps = 0

  def _IsTrainStep(self, fetches):
    model = getattr(self._runner, '_model', None)
    if model is None or not isinstance(fetches, (list, tuple)) or not fetches:
      return False
    return any(fetches[0] is t.train_op for t in model.tasks)

  def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
    n = FLAGS.trace_train_step
    if n > 0 and options is None and self._IsTrainStep(fetches):
      self._train_steps += 1
      if self._train_steps == n:
        options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
        metadata = tf.RunMetadata()
        out = super().run(fetches, feed_dict, options, metadata)
        path = os.path.join(FLAGS.logdir, 'train',
                            f'run_metadata_step_{n}.pb')
        with tf.io.gfile.GFile(path, 'wb') as f:
          f.write(metadata.SerializeToString())
        tf.logging.info('Wrote the RunMetadata of training step %d to %s', n,
                        path)
        return out
    return super().run(fetches, feed_dict, options, run_metadata)


def NewSession(runner, target, graph, config):
  """The runner's session; the trainer's traces --trace_train_step."""
  if FLAGS.trace_train_step > 0 and hasattr(runner, '_step_rate_tracker'):
    return _TracingSession(target, graph=graph, config=config, runner=runner)
  return tf.Session(target, graph=graph, config=config)


class LostTaskReportMixin:
  """Runners say in one line which task they lost when a step fails."""

  def _SetStatusMessage(self, message, retrying=False):
    super()._SetStatusMessage(message, retrying=retrying)
    # Lingvo calls this from its except block, so the error is at hand.
    error = sys.exc_info()[1]
    if not (IsDistributed() and retrying and isinstance(
        error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError))):
      return
    message = str(error)
    tasks = re.findall(r'remote target (/job:\w+/replica:\d+/task:\d+)',
                       message)
    if not tasks:  # E.g. a deadline: name the tasks the error mentions.
      me = f'/job:{FLAGS.job.split(",")[0]}/replica:0/task:{FLAGS.task}'
      tasks = [t for t in re.findall(r'/job:\w+/replica:\d+/task:\d+', message)
               if t != me]
    jobs = cluster.ParseClusterSpec(FLAGS.cluster_spec)
    names = []
    for t in sorted(set(tasks)):
      job, task = cluster.TaskOfDevice(t).split(' task ')
      address = jobs[job][int(task)] if job in jobs else '?'
      names.append(f'{job} task {task} ({t} at {address})')
    kind = type(error).__name__
    print(f'{FLAGS.job}: lost contact with '
          f'{", ".join(names) or "a task of the cluster"} ({kind}); retrying '
          '(Lingvo restores the last checkpoint once it is back).',
          file=sys.stderr, flush=True)
