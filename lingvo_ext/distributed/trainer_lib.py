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
  --cluster_wait_secs exits (`ClusterWatch`), and when a chief that runs both
  clients finishes training it tells the workers and ps tasks, which then
  exit 0 (`SignalDone`, `ServeUntilDone`).
"""

import os
import re
import sys
import threading
import time

import lingvo.compat as tf
from lingvo.core import py_utils
from tensorflow.core.protobuf import config_pb2

from lingvo_ext import trainer_flags  # pylint: disable=unused-import
from lingvo_ext._internal import process
from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import resolvers
from lingvo_ext.distributed import step_keeping

FLAGS = tf.flags.FLAGS

# Moved, kept for old imports.
RestoredLine = step_keeping.RestoredLine
TrainerStepLine = step_keeping.TrainerStepLine


def ResolveCluster(argv):
  """argv with the --cluster_spec, --job and --task of --cluster_resolver.

  Reads the environment once, at the entry point (the trainer re-parses its
  flags from argv), and sets the flags: the one place outside Lingvo that
  writes them.

  Args:
    argv: The trainer's argv, its flags already parsed.

  Returns:
    (argv, error): the argv to run with, or a one-line error for exit 2.
  """
  if not FLAGS.cluster_resolver:
    return argv, None
  given = [f'--{n}' for n in ('cluster_spec', 'job', 'task')
           if FLAGS[n].present]
  if given:
    return argv, (f'--cluster_resolver={FLAGS.cluster_resolver} sets '
                  '--cluster_spec, --job and --task from the environment; '
                  f'drop {", ".join(given)}.')
  if FLAGS.mode != 'sync':
    return argv, (f'--cluster_resolver needs --mode=sync (got --mode='
                  f'{FLAGS.mode}): the chief runs the controller and trainer '
                  'client of a synchronous run.')
  try:
    resolved = resolvers.Resolve(FLAGS.cluster_resolver, FLAGS.slurm_port_base)
  except resolvers.ResolveError as e:
    return argv, str(e)
  FLAGS.cluster_spec = resolved.cluster_spec
  FLAGS.job = resolved.job
  FLAGS.task = resolved.task
  print(f'{resolved.source}: this process is {resolved.job} task '
        f'{resolved.task} of the cluster {resolved.cluster_spec}',
        file=sys.stderr, flush=True)
  return list(argv) + resolved.Flags(), None


def CheckFlags(options):
  """Returns an error message for bad multi-process flags, or None."""
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
      if (FLAGS['worker_replicas'].present and
          FLAGS.worker_replicas != layout.num_replicas):
        return (f'--worker_replicas={FLAGS.worker_replicas} disagrees with '
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


def SessionConfig(options, client=True, **kwargs):
  """Lingvo's session config with this run's devices and step deadline.

  Args:
    options: The trainer's trainer_flags.Options.
    client: For a client's sessions (not a server's default config): they
      see only the worker and ps jobs and their own, so a session does not
      wait for the other clients (TensorFlow's master waits for every task
      it may place ops on before it creates a session).
    **kwargs: Passed to `py_utils.SessionConfig`.
  """
  config = py_utils.SessionConfig(**kwargs)
  config.device_count['CPU'] = options.num_cpu_devices
  if options.distributed:
    config.operation_timeout_in_ms = int(options.worker_timeout_secs * 1000)
    # Collective ops across tasks (task.gradient_sync 'all_reduce'/'hybrid')
    # form their groups through one leader, named alike by every server and
    # client; without it a cross-task collective waits until the deadline.
    config.experimental.collective_group_leader = COLLECTIVE_GROUP_LEADER
    if client:
      own = options.jobs[0]
      config.device_filters.extend(
          sorted({'/job:worker', '/job:ps', f'/job:{own}'}))
  return config


COLLECTIVE_GROUP_LEADER = '/job:worker/replica:0/task:0'

_SERVER_JOBS = ('worker', 'ps', 'input', 'trainer')


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
    # Lingvo sets these only for a process of one job; a chief runs two.
    FLAGS.worker_job = '/job:worker'
    # A ps job holds the variables; without one the workers do.
    FLAGS.ps_job = '/job:ps' if 'ps' in jobs else '/job:worker'
    FLAGS.ps_replicas = len(jobs['ps' if 'ps' in jobs else 'worker'])
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
          config=SessionConfig(o, client=False))
    except ValueError as e:
      _Exit(str(e))
    except tf.errors.OpError as e:
      _Exit(f'{me} could not serve {address} (--cluster_spec): {e.message}; '
            'is the port in use, or the host not this machine?')
    print(f'{me} serving on {address}', file=sys.stderr, flush=True)
    if not FLAGS.tf_master:
      FLAGS.tf_master = self._tf_server.target
    ClusterWatch(jobs, o.jobs, o.task, o.cluster_wait_secs).Start()
    if job in ('worker', 'ps', 'input'):
      return  # Servers only; the clients drive them.
    # Clients need the servers that hold the variables and run the ops, not
    # each other (a restarted controller may find training already done).
    others = {
        f'{j} task {t}': a for j, addrs in jobs.items() if j in _SERVER_JOBS
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
      ServeUntilDone(self._tf_server,  # Does not return.
                     cluster.ParseClusterSpec(o.cluster_spec), job, o.task)
    return super()._CreateRunner(job, model_task_name, logdir, tf_master,
                                 trial)

  def StartRunners(self, all_runners):
    super().StartRunners(all_runners)
    o = self._options
    if not (o.distributed and 'controller' in o.jobs and
            'trainer_client' in o.jobs):
      return
    # This process ran both clients: training is over once the controller
    # saved the checkpoint of the last step (not after Ctrl-C).
    max_steps = [r.params.train.max_steps for r in all_runners
                 if hasattr(r, 'params')]
    path = tf.train.latest_checkpoint(os.path.join(o.logdir, 'train'))
    step = int(path.rsplit('-', 1)[1]) if path else -1
    if max_steps and step >= max(max_steps):
      SignalDone(cluster.ParseClusterSpec(o.cluster_spec), o.job,
                 FLAGS.tf_master, SessionConfig(o))


class ClusterWatch:
  """Exits this process when its peers stop answering (no orphans).

  A server (worker, ps) watches the clients (controller, trainer client); a
  client watches the servers and the other client. Once one of them has not
  accepted a TCP connection for --cluster_wait_secs (from this process's
  start, or since it last did), this process prints which one and exits 1:
  its cluster is gone (a killed launcher, a deleted Kubernetes Job, a
  cancelled Slurm job), so it would otherwise serve or retry forever.
  """

  def __init__(self, jobs, process_jobs, task, wait_s, poll_s=2.0):
    job = process_jobs[0]
    self._me = f'{job} task {task}'
    clients = ('controller', 'trainer_client')
    self._peers = {
        f'{j} task {t}': a for j, addrs in jobs.items()
        for t, a in enumerate(addrs)
        if not (j in process_jobs and t == task) and (
            (j in clients) if job in _SERVER_JOBS else True)
    }
    self._wait_s = wait_s
    self._poll_s = poll_s

  def Start(self):
    if self._peers:
      threading.Thread(target=self._Run, daemon=True,
                       name='ClusterWatch').start()

  def _Run(self):
    seen = {w: time.monotonic() for w in self._peers}
    while True:
      now = time.monotonic()
      for what, address in self._peers.items():
        if cluster.Answers(address):
          seen[what] = now
        elif now - seen[what] > self._wait_s:
          print(f'error: {self._me}: {what} ({address}) has not answered for '
                f'{now - seen[what]:.0f} s (--cluster_wait_secs='
                f'{self._wait_s:g}); the cluster is gone: exiting. Start the '
                'whole cluster again to resume from the last checkpoint.',
                file=sys.stderr, flush=True)
          tf.logging.error('%s gone for %.0f s; exiting.', what,
                           now - seen[what])
          tf.logging.flush()
          process.ExitNow(1)
      time.sleep(self._poll_s)


def _DoneQueue(job, task):
  """The queue on a server task through which the chief says 'done'."""
  with tf.device(f'/job:{job}/replica:0/task:{task}/device:CPU:0'):
    # Same attributes on both sides: a shared queue is one resource.
    return tf.queue.FIFOQueue(
        16, [tf.string], shapes=[[]],
        shared_name=f'lingvo_ext_done_{job}_{task}')


def ServeUntilDone(server, jobs, job, task, linger_s=60.0):
  """Serves until the chief says training is done, then exits 0.

  Lingvo's workers serve forever (`server.join()`), which suits a launcher
  that stops them; under Kubernetes or Slurm nothing would. ClusterWatch
  ends the process (exit 1) if the clients go away without saying so. Told
  'done', the task serves on until the clients have exited (at most
  linger_s), so that their last calls to it finish.
  """
  graph = tf.Graph()
  with graph.as_default():
    take = _DoneQueue(job, task).dequeue()
  config = config_pb2.ConfigProto()
  config.device_filters.append(f'/job:{job}/replica:0/task:{task}')
  # The server's sessions have a deadline (--worker_timeout_secs): wait in
  # shorter calls.
  options = tf.RunOptions(timeout_in_ms=10000)
  with tf.Session(server.target, graph=graph, config=config) as sess:
    while True:
      try:
        who = sess.run(take, options=options)
        break
      except tf.errors.DeadlineExceededError:
        pass
  clients = [a for j in ('controller', 'trainer_client')
             for a in jobs.get(j, ())]
  deadline = time.monotonic() + linger_s
  while time.monotonic() < deadline and any(
      cluster.Answers(a) for a in clients):
    time.sleep(0.5)
  print(f'{job} task {task}: {who.decode()} finished training; exiting.',
        file=sys.stderr, flush=True)
  tf.logging.info('Training finished; exiting.')
  tf.logging.flush()
  process.ExitNow(0)


def SignalDone(jobs, me, target, config, timeout_s=10.0):
  """Tells every worker and ps task that training is done."""
  graph = tf.Graph()
  with graph.as_default():
    ops = {f'{j} task {t}': _DoneQueue(j, t).enqueue(me)
           for j in ('worker', 'ps') for t in range(len(jobs.get(j, ())))}
  options = tf.RunOptions(timeout_in_ms=int(timeout_s * 1000))
  with tf.Session(target, graph=graph, config=config) as sess:
    for what, op in ops.items():
      try:
        sess.run(op, options=options)
      except tf.errors.OpError as e:  # It exits on its own (ClusterWatch).
        tf.logging.warning('Could not tell %s that training is done: %s',
                           what, e.message)
  tf.logging.info('Told %d server task(s) that training is done.', len(ops))


def SilentTasks(jobs, timeout_s=5.0):
  """['worker task 1', ...]: server tasks that do not answer within timeout_s.

  A hung task (stopped, swapping) still accepts TCP connections, so this asks
  each task's TensorFlow server for its devices, with a deadline.
  """
  answered = set()
  tasks = [(j, t, a) for j, addrs in jobs.items() if j in _SERVER_JOBS
           for t, a in enumerate(addrs)]

  def Probe(job, task, address):
    config = config_pb2.ConfigProto(
        operation_timeout_in_ms=int(timeout_s * 1000))
    config.device_filters.append(f'/job:{job}/replica:0/task:{task}')
    try:
      with tf.Session(f'grpc://{address}', graph=tf.Graph(),
                      config=config) as sess:
        sess.list_devices()
      answered.add((job, task))
    except Exception:  # pylint: disable=broad-except
      pass

  threads = [threading.Thread(target=Probe, args=x, daemon=True)
             for x in tasks]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout_s + 5)
  return [(j, t) for j, t, _ in tasks if (j, t) not in answered]


class LostTaskReportMixin:
  """Runners say in one line which task they lost when a step fails.

  The runner has `self._options` (trainer_flags.Options).
  """

  def _SetStatusMessage(self, message, retrying=False):
    super()._SetStatusMessage(message, retrying=retrying)
    # Lingvo calls this from its except block, so the error is at hand.
    error = sys.exc_info()[1]
    deadline = isinstance(error, tf.errors.DeadlineExceededError)
    o = self._options
    if not (o.distributed and (retrying or deadline) and isinstance(
        error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError))):
      return
    print(LostTaskLine(o, error, retrying), file=sys.stderr, flush=True)


def LostTaskLine(options, error, retrying):
  """'JOB: lost contact with worker task 1 (...); retrying.' for `error`."""
  message = str(error)
  deadline = isinstance(error, tf.errors.DeadlineExceededError)
  tasks = re.findall(r'remote target (/job:\w+/replica:\d+/task:\d+)',
                     message)
  me = f'/job:{options.jobs[0]}/replica:0/task:{options.task}'
  if not tasks:  # E.g. a deadline: name the tasks the error mentions.
    tasks = [t for t in re.findall(r'/job:\w+/replica:\d+/task:\d+', message)
             if t != me]
  jobs = cluster.ParseClusterSpec(options.cluster_spec)
  if not tasks and deadline:  # A hung task: ask each one.
    tasks = [f'/job:{j}/replica:0/task:{t}' for j, t in SilentTasks(jobs)]
    tasks = [t for t in tasks if t != me]
  names = []
  for t in sorted(set(tasks)):
    job, task = cluster.TaskOfDevice(t).split(' task ')
    address = jobs[job][int(task)] if job in jobs else '?'
    names.append(f'{job} task {task} ({t} at {address})')
  kind = type(error).__name__
  then = ('retrying (Lingvo restores the last checkpoint once it is back)'
          if retrying else 'exiting (lingvo_ext.launch restarts this '
          'process; on your own hosts, re-run its command)')
  return (f'{options.job}: lost contact with '
          f'{", ".join(names) or "a task of the cluster"} ({kind}); {then}.')
