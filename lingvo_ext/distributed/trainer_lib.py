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
from lingvo.core import checkpointer as lingvo_checkpointer
from lingvo.core import py_utils
from tensorflow.core.protobuf import config_pb2

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import resolvers

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


tf.flags.DEFINE_enum(
    'cluster_resolver', None, list(resolvers.RESOLVERS),
    'Read the cluster, --job and --task from the environment instead of '
    '--cluster_spec: tf_config (the TF_CONFIG variable that Kubeflow\'s '
    'TFJob, JobSet, Vertex AI and SageMaker set) or slurm (the SLURM_* '
    'variables of a task started by srun). TF_CONFIG\'s "chief" task (Slurm: '
    'rank 0) runs the controller and the trainer client, "worker" task i '
    'is worker i, "ps" tasks are ps. Every process gets the same flags.')
tf.flags.DEFINE_integer(
    'slurm_port_base', 8888,
    'With --cluster_resolver=slurm: Slurm rank r serves port '
    'slurm_port_base + r.')


def ResolveCluster(argv):
  """argv with the --cluster_spec, --job and --task of --cluster_resolver.

  Reads the environment once, at the entry point (the trainer re-parses its
  flags from argv), and sets the flags.

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
    # Collective ops across tasks (task.gradient_sync 'all_reduce'/'hybrid')
    # form their groups through one leader, named alike by every server and
    # client; without it a cross-task collective waits until the deadline.
    config.experimental.collective_group_leader = COLLECTIVE_GROUP_LEADER
    if client:
      own = FLAGS.job.split(',')[0]
      config.device_filters.extend(
          sorted({'/job:worker', '/job:ps', f'/job:{own}'}))
  return config


COLLECTIVE_GROUP_LEADER = '/job:worker/replica:0/task:0'

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
    ClusterWatch(jobs, FLAGS.job.split(','), FLAGS.task,
                 FLAGS.cluster_wait_secs).Start()
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

  def _CreateRunner(self, job, model_task_name, logdir, tf_master, trial):
    if IsDistributed() and job in ('worker', 'ps'):
      ServeUntilDone(self._tf_server,  # Does not return.
                     cluster.ParseClusterSpec(FLAGS.cluster_spec), job,
                     FLAGS.task)
    return super()._CreateRunner(job, model_task_name, logdir, tf_master,
                                 trial)

  def StartRunners(self, all_runners):
    super().StartRunners(all_runners)
    jobs = FLAGS.job.split(',') if FLAGS.job else []
    if not (IsDistributed() and 'controller' in jobs and
            'trainer_client' in jobs):
      return
    # This process ran both clients: training is over once the controller
    # saved the checkpoint of the last step (not after Ctrl-C).
    max_steps = [r.params.train.max_steps for r in all_runners
                 if hasattr(r, 'params')]
    path = tf.train.latest_checkpoint(os.path.join(FLAGS.logdir, 'train'))
    step = int(path.rsplit('-', 1)[1]) if path else -1
    if max_steps and step >= max(max_steps):
      SignalDone(cluster.ParseClusterSpec(FLAGS.cluster_spec), FLAGS.job)


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
          os._exit(1)  # pylint: disable=protected-access
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
  os._exit(0)  # pylint: disable=protected-access


def SignalDone(jobs, me, timeout_s=10.0):
  """Tells every worker and ps task that training is done."""
  graph = tf.Graph()
  with graph.as_default():
    ops = {f'{j} task {t}': _DoneQueue(j, t).enqueue(me)
           for j in ('worker', 'ps') for t in range(len(jobs.get(j, ())))}
  options = tf.RunOptions(timeout_in_ms=int(timeout_s * 1000))
  with tf.Session(FLAGS.tf_master, graph=graph,
                  config=SessionConfig()) as sess:
    for what, op in ops.items():
      try:
        sess.run(op, options=options)
      except tf.errors.OpError as e:  # It exits on its own (ClusterWatch).
        tf.logging.warning('Could not tell %s that training is done: %s',
                           what, e.message)
  tf.logging.info('Told %d server task(s) that training is done.', len(ops))


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


def SilentTasks(jobs, timeout_s=5.0):
  """['worker task 1', ...]: server tasks that do not answer within timeout_s.

  A hung task (stopped, swapping) still accepts TCP connections, so this asks
  each task's TensorFlow server for its devices, with a deadline.
  """
  import threading  # pylint: disable=g-import-not-at-top
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
  """Runners say in one line which task they lost when a step fails."""

  def _SetStatusMessage(self, message, retrying=False):
    super()._SetStatusMessage(message, retrying=retrying)
    # Lingvo calls this from its except block, so the error is at hand.
    error = sys.exc_info()[1]
    deadline = isinstance(error, tf.errors.DeadlineExceededError)
    if not (IsDistributed() and (retrying or deadline) and isinstance(
        error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError))):
      return
    message = str(error)
    tasks = re.findall(r'remote target (/job:\w+/replica:\d+/task:\d+)',
                       message)
    me = f'/job:{FLAGS.job.split(",")[0]}/replica:0/task:{FLAGS.task}'
    if not tasks:  # E.g. a deadline: name the tasks the error mentions.
      tasks = [t for t in re.findall(r'/job:\w+/replica:\d+/task:\d+', message)
               if t != me]
    jobs = cluster.ParseClusterSpec(FLAGS.cluster_spec)
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
    print(f'{FLAGS.job}: lost contact with '
          f'{", ".join(names) or "a task of the cluster"} ({kind}); {then}.',
          file=sys.stderr, flush=True)


def _StepLine(message):
  print(f'{FLAGS.job}: {message}', file=sys.stderr, flush=True)
  tf.logging.info('%s', message)


class StepKeepingRestore:
  """The controller's restore in a live cluster: weights back, step kept.

  When a worker restarts, its variables are uninitialized and Lingvo's
  controller restores every variable from the last checkpoint, the global
  step too: the step counter would fall back to the checkpoint's step and
  the trainer would redo (and summarize again) the steps since. Instead,
  once the run is live (the step counter is initialized, or this controller
  has seen a step), this restores every variable BUT the global step from
  the last checkpoint; a global step that was lost with its worker is set to
  the highest step this controller has seen (the trainer raises it further
  to its own last step, see `KeepTrainerStep`). The updates of the steps
  since that checkpoint are lost; their step numbers are not reused.

  At the start of a run (nothing seen, counter uninitialized) it is Lingvo's
  RestoreIfNeeded: initialize, or restore the last checkpoint whole.
  """

  def __init__(self, runner):
    self._ckpt = runner._checkpointer  # pylint: disable=protected-access
    self._train_dir = self._ckpt.checkpoint_dir
    self.max_seen = None
    graph = runner._graph  # pylint: disable=protected-access
    with graph.as_default(), tf.container(runner._container_id):  # pylint: disable=protected-access
      self._global_step = py_utils.GetOrCreateGlobalStepVar()
      gs_name = self._global_step.op.name
      # What Lingvo's checkpointer saves, by checkpoint key.
      var_list = {
          k: v for k, v in lingvo_checkpointer._GetSaveableVariablesDict(  # pylint: disable=protected-access
              self._ckpt._models).items()  # pylint: disable=protected-access
          if v.op.name != gs_name and k != 'global_step'
      }
      self._saver = tf.train.Saver(var_list=var_list) if var_list else None
      # The rest (e.g. Lingvo's async_ckpt/ copies of the variables, which
      # checkpoints do not hold) starts afresh, as Lingvo's restore does.
      saved = {v.op.name for v in var_list.values()} | {gs_name}
      self._init_rest = tf.variables_initializer(
          [v for v in tf.global_variables() if v.op.name not in saved])
      self._step_value = tf.placeholder(tf.int64, [], name='keep_step_value')
      self._assign_step = self._global_step.assign(self._step_value)
      self._read_step = self._global_step.read_value()
    self._restore_if_needed = self._ckpt.RestoreIfNeeded
    self._maybe_save = self._ckpt.MaybeSave
    self._ckpt.RestoreIfNeeded = self.RestoreIfNeeded
    self._ckpt.MaybeSave = self.MaybeSave

  def Seen(self, step):
    if step is not None:
      self.max_seen = max(int(step), self.max_seen or 0)

  def MaybeSave(self, sess=None, gsteps=None):
    self.Seen(gsteps)
    return self._maybe_save(sess, gsteps)

  def RestoreIfNeeded(self, sess):
    """Lingvo's RestoreIfNeeded, keeping the step counter of a live run."""
    names = self._ckpt._GetUninitializedVarNames(sess)  # pylint: disable=protected-access
    if not names:
      return None
    step_lost = any(n == b'global_step' for n in names)
    path = tf.train.latest_checkpoint(self._train_dir)
    if (step_lost and self.max_seen is None) or not path or not self._saver:
      out = self._restore_if_needed(sess)
      self.Seen(sess.run(self._read_step))
      return out
    self._saver.restore(sess, path)
    sess.run(self._init_rest)
    saved = int(tf.train.load_checkpoint(path).get_tensor('global_step'))
    if step_lost:
      step = max(saved, self.max_seen or 0)
      sess.run(self._assign_step, {self._step_value: step})
    else:
      step = int(sess.run(self._read_step))
    self.Seen(step)
    _StepLine(RestoredLine(len(names), names[0].decode(),
                           os.path.basename(path), saved, step))
    return path


def RestoredLine(num_uninitialized, example, checkpoint, saved, step):
  """The controller's line after restoring the weights in a live run.

  `step` is where this controller sets the counter; the trainer raises it to
  its own last step (KeepTrainerStep says so), so the lost updates are named
  from the checkpoint on, not as a range this controller cannot know the
  end of.
  """
  return (f'{num_uninitialized} variable(s) were uninitialized (e.g. '
          f'{example}: a restarted task); restored the weights of '
          f'{checkpoint} (saved at step {saved}); the step counter goes on '
          f'from {step}, or from the trainer\'s last step if that is higher '
          f'(the trainer says so); the updates of the steps after {saved} are '
          'lost.')


def TrainerStepLine(global_step, last):
  """The trainer's line when it raises a restored global step."""
  return (f'the global step was {global_step} (a restored checkpoint); set '
          f'it back to {last}, the last step this trainer ran, so that no '
          f'step number is reused (the updates of steps {global_step + 1}..'
          f'{last} are lost).')


class KeepTrainerStep:
  """The trainer raises a global step that went below its last step.

  The trainer client is the one process that steps, so it knows the last
  step it ran; when it starts its loop again after a failure (a lost task),
  it sets a lower global step (one restored from a checkpoint) back to that
  step before it runs another. No step number is summarized twice.
  """

  def __init__(self, runner):
    self.last = 0
    if not IsDistributed():
      return
    with runner._graph.as_default():  # pylint: disable=protected-access
      gs = py_utils.GetOrCreateGlobalStepVar()
      self._value = tf.placeholder(tf.int64, [], name='keep_trainer_step')
      self._assign = gs.assign(self._value)

  def Ran(self, step):
    self.last = max(self.last, int(step))

  def Keep(self, sess, global_step):
    """Returns the global step to go on from after _WaitUntilInit."""
    global_step = int(global_step)
    if global_step < self.last:
      sess.run(self._assign, {self._value: self.last})
      _StepLine(TrainerStepLine(global_step, self.last))
      return self.last
    self.Ran(global_step)
    return global_step
