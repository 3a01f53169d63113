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
  whose worker vanished reports it instead of hanging;
- --cluster_resolver=tf_config|slurm: the cluster, --job and --task from
  TF_CONFIG or Slurm's environment (resolvers.py); TF_CONFIG's chief is one
  process running the controller and the trainer client;
- no process outlives its cluster: a task whose peers (a server's clients,
  a client's servers and other client) do not answer for
  --cluster_wait_secs exits (`ClusterWatch`), and when the controller (or a
  chief that runs both clients) finishes training it tells the workers and
  ps tasks, which then exit 0 once the clients have (`SignalDone`,
  `ServeUntilDone`).
"""

import os
import sys
from typing import Optional
from typing import Sequence

import lingvo.compat as tf

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import resolvers
from lingvo_ext.distributed import server

FLAGS = tf.flags.FLAGS


def ResolveCluster(cluster_resolver: str, mode: str, slurm_port_base: int,
                   given: Sequence[str] = ()):
  """(resolved, error) of --cluster_resolver: the environment read once.

  The entry point reads the flags and writes the resolved --cluster_spec,
  --job and --task back for Lingvo's runners.

  Args:
    cluster_resolver: --cluster_resolver ('' for none).
    mode: --mode.
    slurm_port_base: --slurm_port_base.
    given: The flags among --cluster_spec, --job, --task given too.

  Returns:
    (resolvers.Resolved or None, a one-line error for exit 2 or None).
  """
  if not cluster_resolver:
    return None, None
  if given:
    return None, (f'--cluster_resolver={cluster_resolver} sets '
                  '--cluster_spec, --job and --task from the environment; '
                  f'drop {", ".join(given)}.')
  if mode != 'sync':
    return None, (f'--cluster_resolver needs --mode=sync (got --mode='
                  f'{mode}): the chief runs the controller and trainer '
                  'client of a synchronous run.')
  try:
    resolved = resolvers.Resolve(cluster_resolver, slurm_port_base)
  except resolvers.ResolveError as e:
    return None, str(e)
  print(f'{resolved.source}: this process is {resolved.job} task '
        f'{resolved.task} of the cluster {resolved.cluster_spec}',
        file=sys.stderr, flush=True)
  return resolved, None


# Lingvo's trainer reads these from FLAGS, not from its params: its
# RunnerManager.UpdateClusterParamsFromFlags reads --worker_job, --ps_job,
# --ps_replicas and --worker_replicas, and its CreateRunners hands --tf_master
# to every runner (lingvo/trainer.py). Its MaybeConfigRunDistributed and
# MaybeLaunchTensorFlow write them; the manager's overrides below write them
# again at start-up, after Lingvo's, through these two functions only.
def _SetLingvoFlags(**values):
  for name, value in values.items():
    setattr(FLAGS, name, value)


def _LingvoMaster() -> str:
  return FLAGS.tf_master


def CheckFlags(options, worker_replicas: Optional[int] = None):
  """Returns an error message for bad multi-process flags, or None.

  Args:
    options: The trainer's trainer_flags.Options.
    worker_replicas: --worker_replicas where given, else None.
  """
  if not options.distributed:
    return None
  try:
    jobs = cluster.ParseClusterSpec(options.cluster_spec)
    if not options.job:
      return ('--job is required with --cluster_spec, e.g. --job=worker '
              '--task=0 (or controller, trainer_client).')
    cluster.CheckClusterFlags(jobs, options.mode, options.jobs, options.task)
    if options.mode == 'sync':
      layout = cluster.MakeWorkerLayout(
          len(jobs['worker']), options.devices_per_task,
          options.worker_split_size)
      if (worker_replicas is not None and
          worker_replicas != layout.num_replicas):
        return (f'--worker_replicas={worker_replicas} disagrees with '
                f'--cluster_spec: {len(jobs["worker"])} worker task(s) x '
                f'{options.devices_per_task} device(s) / --worker_split_size='
                f'{options.worker_split_size} make {layout.num_replicas} '
                'replica(s); drop --worker_replicas or change the worker '
                'count.')
  except ValueError as e:
    return str(e)
  if options.cluster_wait_secs <= 0 or options.worker_timeout_secs <= 0:
    return '--cluster_wait_secs and --worker_timeout_secs must be > 0.'
  return None


def _Exit(message):
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(2)


class DistributedRunnerManagerMixin:
  """RunnerManager methods for --cluster_spec runs (see module doc).

  The manager has `self._options` (trainer_flags.Options). Lingvo's own
  protocol stays: it reads --worker_job, --ps_job, --ps_replicas,
  --worker_replicas and --tf_master after MaybeConfigRunDistributed and
  MaybeLaunchTensorFlow, which set them as Lingvo's do.
  """

  def _Layout(self):
    o = self._options
    jobs = cluster.ParseClusterSpec(o.cluster_spec)
    return jobs, cluster.MakeWorkerLayout(len(jobs['worker']),
                                          o.devices_per_task,
                                          o.worker_split_size)

  def MaybeConfigRunDistributed(self):
    super().MaybeConfigRunDistributed()
    if not self._options.distributed or self._options.mode != 'sync':
      return
    jobs, layout = self._Layout()
    _SetLingvoFlags(
        # Lingvo sets these only for a process of one job; a chief runs two.
        worker_job='/job:worker',
        # A ps job holds the variables; without one the workers do.
        ps_job='/job:ps' if 'ps' in jobs else '/job:worker',
        ps_replicas=len(jobs['ps' if 'ps' in jobs else 'worker']),
        # Lingvo made each worker task a replica; replicas are splits instead.
        worker_replicas=layout.num_replicas)
    tf.logging.info(
        'Cluster layout: %d worker task(s) x %d device(s), %d replica(s) of '
        '%d cell device(s): %s', layout.num_tasks, layout.devices_per_task,
        layout.num_replicas, layout.split_size, '; '.join(
            f'replica {r} cell {i} on {layout.Device(r, i)}'
            for r in range(layout.num_replicas)
            for i in range(layout.split_size)))

  def UpdateClusterParamsFromFlags(self, cluster_p, job_name):
    super().UpdateClusterParamsFromFlags(cluster_p, job_name)
    if not self._options.distributed or self._options.mode != 'sync':
      return
    jobs, layout = self._Layout()
    cluster.UpdateClusterParams(cluster_p, layout, jobs,
                                self._options.num_cpu_devices,
                                self._options.jobs[0])

  def MaybeLaunchTensorFlow(self):
    """Starts this task's server; clients wait for the others to answer."""
    o = self._options
    if not o.distributed:
      return super().MaybeLaunchTensorFlow()
    jobs = cluster.ParseClusterSpec(o.cluster_spec)
    job = o.jobs[0]
    me = f'{job} task {o.task}'
    address = jobs[job][o.task]
    try:
      cluster.CheckPortFree(address, me)
      self._tf_server = tf.distribute.Server(
          tf.train.ClusterSpec(jobs),
          job_name=job,
          task_index=o.task,
          config=server.SessionConfig(o, client=False))
    except ValueError as e:
      _Exit(str(e))
    except tf.errors.OpError as e:
      _Exit(f'{me} could not serve {address} (--cluster_spec): {e.message}; '
            'is the port in use, or the host not this machine?')
    print(f'{me} serving on {address}', file=sys.stderr, flush=True)
    if not _LingvoMaster():
      _SetLingvoFlags(tf_master=self._tf_server.target)
    server.ClusterWatch(jobs, o.jobs, o.task, o.cluster_wait_secs).Start()
    if job in ('worker', 'ps', 'input'):
      return  # Servers only; the clients drive them.
    # Clients need the servers that hold the variables and run the ops, not
    # each other (a restarted controller may find training already done).
    others = {
        f'{j} task {t}': a for j, addrs in jobs.items()
        if j in server.SERVER_JOBS
        for t, a in enumerate(addrs) if a != address
    }
    try:
      cluster.WaitForAddresses(others, o.cluster_wait_secs)
    except TimeoutError as e:
      _Exit(f'{me}: {e}')
    tf.logging.info('All %d other task(s) answer.', len(others))

  def _CreateRunner(self, job, model_task_name, logdir, tf_master, trial):
    o = self._options
    if o.distributed and job in ('worker', 'ps'):
      server.ServeUntilDone(  # Does not return.
          self._tf_server, cluster.ParseClusterSpec(o.cluster_spec), job,
          o.task)
    return super()._CreateRunner(job, model_task_name, logdir, tf_master,
                                 trial)

  def StartRunners(self, all_runners):
    super().StartRunners(all_runners)
    o = self._options
    if not (o.distributed and 'controller' in o.jobs):
      return
    # This process ran the controller: training is over once it saved the
    # checkpoint of the last step (not after Ctrl-C). The workers serve on
    # until the trainer client has exited too.
    max_steps = [r.params.train.max_steps for r in all_runners
                 if hasattr(r, 'params')]
    path = tf.train.latest_checkpoint(os.path.join(o.logdir, 'train'))
    step = int(path.rsplit('-', 1)[1]) if path else -1
    if max_steps and step >= max(max_steps):
      server.SignalDone(cluster.ParseClusterSpec(o.cluster_spec), o.job,
                        _LingvoMaster(), server.SessionConfig(o))


