"""A cluster task's sessions and server: config, watch, and the end of a run.

`SessionConfig` gives every session the run's devices, its deadline
(--worker_timeout_secs) and the collective group leader; `ClusterWatch`
ends a task whose peers are gone; a chief that finishes training tells the
servers (`SignalDone`), which serve until then (`ServeUntilDone`).
"""

import sys
import threading
import time

import lingvo.compat as tf
from lingvo.core import py_utils
from tensorflow.core.protobuf import config_pb2

from lingvo_ext import session_config
from lingvo_ext._internal import process
from lingvo_ext.distributed import cluster


def SessionConfig(options, client=True, **kwargs):
  """Lingvo's session config with this run's devices and step deadline,
  Grappler's idle passes off on CPU (`WithoutIdlePasses`, a run with GPUs
  keeps TensorFlow's; session_config.py) and its remapper off where `options.grappler_remapping`
  says so.

  Args:
    options: The trainer's trainer_flags.Options.
    client: For a client's sessions (not a server's default config): they
      see only the worker and ps jobs and their own, so a session does not
      wait for the other clients (TensorFlow's master waits for every task
      it may place ops on before it creates a session).
    **kwargs: Passed to `py_utils.SessionConfig`.
  """
  config = py_utils.SessionConfig(**kwargs)
  if not options.worker_gpus:
    session_config.WithoutIdlePasses(config)
  if not options.grappler_remapping:
    session_config.WithoutRemapper(config)
  config.device_count['CPU'] = options.num_cpu_devices
  # A server made before any tf.function makes the process's pool.
  config.intra_op_parallelism_threads = options.IntraOpThreads()
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

# Jobs whose tasks serve (the clients drive them).
SERVER_JOBS = ('worker', 'ps', 'input', 'trainer')
_SERVER_JOBS = SERVER_JOBS


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
  cluster.PollUntil(lambda: not any(cluster.Answers(a) for a in clients),
                    linger_s, 0.5)
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
