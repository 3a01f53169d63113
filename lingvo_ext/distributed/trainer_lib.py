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


def SessionConfig(**kwargs):
  """Lingvo's session config with this run's devices and step deadline."""
  config = py_utils.SessionConfig(**kwargs)
  config.device_count['CPU'] = FLAGS.num_cpu_devices
  if IsDistributed():
    config.operation_timeout_in_ms = int(FLAGS.worker_timeout_secs * 1000)
  return config


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
    cluster.UpdateClusterParams(cluster_p, layout, jobs, FLAGS.num_cpu_devices)

  def MaybeLaunchTensorFlow(self):
    """Starts this task's server; clients wait for the others to answer."""
    if not IsDistributed():
      return super().MaybeLaunchTensorFlow()
    jobs = cluster.ParseClusterSpec(FLAGS.cluster_spec)
    job = FLAGS.job.split(',')[0]
    me = f'{job} task {FLAGS.task}'
    address = jobs[job][FLAGS.task]
    cluster.CheckPortFree(address, me)
    try:
      self._tf_server = tf.distribute.Server(
          tf.train.ClusterSpec(jobs),
          job_name=job,
          task_index=FLAGS.task,
          config=SessionConfig())
    except tf.errors.OpError as e:
      raise ValueError(f'{me} could not serve {address} (--cluster_spec): '
                       f'{e.message}; is the port in use?') from None
    print(f'{me} serving on {address}', file=sys.stderr, flush=True)
    if not FLAGS.tf_master:
      FLAGS.tf_master = self._tf_server.target
    if job in ('worker', 'ps', 'input'):
      return  # Servers only; the clients drive them.
    others = {
        f'{j} task {t}': a for j, addrs in jobs.items()
        for t, a in enumerate(addrs) if a != address
    }
    cluster.WaitForAddresses(others, FLAGS.cluster_wait_secs)
    tf.logging.info('All %d other task(s) answer.', len(others))
