"""Starts, watches and stops a local TensorFlow cluster of trainer processes.

`lingvo_ext.launch` is the command line; launching.Launch runs the
network and the clusters; a `Launcher` runs one cluster:

1. lays the cluster out on free ports of 127.0.0.1, each task told its
   place as --cluster_from says (cluster_tasks.py); --ps adds ps tasks;
2. runs each as `python -m lingvo_ext.trainer ...` plus the user's trainer
   flags (forked from a server that has imported TensorFlow and Lingvo once,
   `fork_server`; with fork_tasks=False, or where it cannot, a fresh
   interpreter), in its own process group, writing its whole output to
   LOGDIR/launch/JOB.TASK.log (a file: a slow reader of the launcher's
   output never blocks a task). Each task gets PR_SET_PDEATHSIG=SIGKILL, so
   it dies with the launcher however the launcher dies (kill -9 included);
3. prints each task's state changes (started, ready, lost, restarted,
   finished), the trainer's progress line and the tasks' own one-line
   messages (errors, lost contact, restores); --stream_logs prints every
   line of every task, prefixed with its name (task_output.py);
4. waits (--ready_timeout_secs) until every task's port answers;
5. restarts a task that dies (at most --max_restarts times in all): the
   controller restores the weights of the last checkpoint when it finds
   variables uninitialized on a fresh worker, keeping the step counter where
   training was (step_keeping.StepKeepingRestore); the trainer client retries
   its step. A worker that dies past --max_restarts, or a restarted task
   that does not serve within --ready_timeout_secs, is lost for good: with
   elastic=True the Launcher returns EXIT_LOST (`lost` says which and why)
   and launching.py re-plans onto the workers left (elastic.py);
6. ends when the clients (controller and trainer client, or the chief) exit
   0 (training reached --max_steps), stopping the workers; on Ctrl-C, on a
   failure it cannot restart, or when a task fails to come up, stops every
   process it started and exits non-zero.

By default (--network=private) the launcher first moves itself into a
network namespace with only a loopback interface (network.py: TensorFlow's
gRPC servers listen on every interface and do no authentication).
--network=host skips that (for systems without namespaces) and warns.
"""

import collections
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List
from typing import Optional

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import cluster_tasks
from lingvo_ext.distributed import elastic
from lingvo_ext.distributed import fork_server
from lingvo_ext.distributed import fork_serving
from lingvo_ext.distributed import network
from lingvo_ext.distributed import task_health
from lingvo_ext.distributed import task_output

# Kept where callers found them (the cluster's layout and network moved out).
CLUSTER_FROM = cluster_tasks.CLUSTER_FROM
ClusterJobs = cluster_tasks.ClusterJobs
ClusterTasks = cluster_tasks.ClusterTasks
Task = cluster_tasks.Task
TaskCommand = cluster_tasks.TaskCommand
EnterPrivateNetwork = network.EnterPrivateNetwork
FreePortRange = network.FreePortRange
FreePorts = network.FreePorts

EXIT_NOT_SAVED = 143
# A task's exit status for a full disk (runtime/disk_space.py: EX_IOERR).
EXIT_DISK_FULL = 74
EXIT_INPUT_BROKE = 65  # Its input files broke (tasks/input_files.py).
# The launcher's exit status when the kernel's OOM killer ended a task.
EXIT_OOM = 137
# Watch's return when a worker is lost for good and elastic is on: not an
# exit status, launching.py re-plans.
EXIT_LOST = -1
# Exits that the same task would repeat if restarted: the launcher stops the
# cluster with that status. 2: bad flags, params or input (trainer.py);
# 4: an evaler's or decoder's evaluation failed (local_evaler.py); 65: the
# input files broke during the run (tasks/input_files.py).
NOT_RESTARTED = {2: 'it refused its input', 4: 'its evaluation failed',
                 65: 'its input files broke'}
# Jobs whose exit 0 means training is done.
CLIENT_JOBS = ('controller', 'trainer_client', 'chief')


def SignalName(rc: int) -> str:
  """'signal SIGKILL' or 'exit code 3' for a return code."""
  if rc < 0:
    try:
      return f'signal {signal.Signals(-rc).name}'
    except ValueError:
      return f'signal {-rc}'
  return f'exit code {rc}'


class Launcher:
  """Runs the tasks of one local cluster; see the module docstring."""

  def __init__(self, tasks: List[Task], logdir: str, ready_timeout_s: float,
               max_restarts: int, out=None, stream_logs: bool = False,
               fork_tasks: bool = True, task_timeout_s: float = 60,
               elastic: bool = False, shared_fork_server=None,
               since_loss: Optional[float] = None):
    self._logdir = os.path.join(logdir, 'launch')
    self._elastic = elastic
    # The run's fork server (launching.py), closed by its owner, not here.
    self._shared_server = shared_fork_server
    # time.monotonic() of the loss this cluster recovers from, till its
    # first trained step.
    self._since_loss = since_loss
    self.lost = None  # An elastic.Loss once Watch returned EXIT_LOST.
    self.lost_at = None
    self._task_timeout_s = task_timeout_s
    # The cgroup's OOM kill count (task_health.OomKills; tests replace it).
    self.oom_kills = task_health.OomKills
    self._fork_tasks = fork_tasks
    self._fork_server = None
    os.makedirs(self._logdir, exist_ok=True)
    self._output = task_output.Output(out or sys.stdout, self._logdir)
    self._stream_logs = stream_logs
    self._ready_timeout_s = ready_timeout_s
    self._max_restarts = max_restarts
    self._tail_lock = threading.Lock()
    self._stop_tail = threading.Event()
    self.restarts = 0
    self.tasks = tasks
    for t in tasks:
      t.log_path = os.path.join(self._logdir, f'{t.job}.{t.task}.log')
      # A resumed run appends to the logs: only this run's lines are shown.
      t.log_pos = (os.path.getsize(t.log_path)
                   if os.path.exists(t.log_path) else 0)
    self._pipes = task_output.OpenErrorPipes(tasks)  # Each task's errors.
    self._tail = threading.Thread(target=self._TailLoop, daemon=True,
                                  name='tail')
    self._tail.start()

  def Print(self, line: str) -> None:
    self._output.Put(line)

  def Flush(self, timeout_s: float = 5) -> None:
    self._output.Flush(timeout_s)

  def _TailOnce(self) -> None:
    """Shows the lines the tasks wrote to their logs since the last call."""
    with self._tail_lock:
      for task in self.tasks:
        task_output.ShowNewLines(task, self._output, self._stream_logs,
                                 self._Saw)

  def _Saw(self, task: Task, line: str) -> None:
    """Says the recovery's time at the first step trained after a loss."""
    if self._since_loss is None or task.job not in ('trainer_client',
                                                    'chief'):
      return
    step = elastic.StepOf(line)
    if step is not None:
      seconds = time.monotonic() - self._since_loss
      self._since_loss = None
      workers = sum(t.job == 'worker' for t in self.tasks)
      self.Print(elastic.RecoveredLine(step, seconds, workers))

  def _TailLoop(self) -> None:
    while not self._stop_tail.wait(0.2):
      try:
        self._TailOnce()
      except OSError:
        pass

  def Start(self, task: Task) -> None:
    """Starts `task`; call from the main thread only (PR_SET_PDEATHSIG is
    tied to the thread that forks)."""
    env = dict(os.environ, **task.env,
               **{task_output.ERROR_PIPE_ENV: task.errors.path})
    with self._tail_lock:
      with open(task.log_path, 'ab') as log:
        shown = ' '.join(f'{k}={shlex.quote(v)}' for k, v in task.env.items())
        log.write(f'=== launch: starting {task.what} at '
                  f'{time.strftime("%H:%M:%S")}: {shown} '
                  f'{shlex.join(task.argv)}\n'.encode())
        task.log_pos, task.partial = log.tell(), b''
        task.proc = None
        if self._fork_server:
          log.flush()
          task.proc = self._fork_server.Spawn(task.argv, env, task.log_path)
        if task.proc is None:
          task.proc = subprocess.Popen(
              task.argv,
              stdout=log,
              stderr=subprocess.STDOUT,
              stdin=subprocess.DEVNULL,
              env=env,
              preexec_fn=fork_serving.DieWithParent(os.getpid()),
              start_new_session=True)  # Its own process group.
    task.started_at = time.monotonic()
    task.last_answer = task.started_at
    task.ready = False
    task.hung = False
    task.rss = task_health.RssBytes(task.proc.pid)
    task.cgroup = task_health.CgroupDir(task.proc.pid)
    task.oom_kills = self.oom_kills(task.cgroup)
    self.Print(f'launch: started {task.what} as pid {task.proc.pid}; log: '
               f'{task.log_path}')

  def StartAll(self) -> None:
    """Starts the fork server (if asked) and every task."""
    if self._shared_server:
      self._fork_server = self._shared_server
    elif self._fork_tasks:
      server = fork_server.ForkServer(
          'lingvo_ext.trainer', os.path.join(self._logdir, 'fork_server.stderr'))
      why = server.Start(self._ready_timeout_s)
      if why:
        self.Print(f'launch: starting each task as a fresh interpreter: {why}')
      else:
        self._fork_server = server
        self.Print(f'launch: forking the tasks from pid {server.pid}, which '
                   'has imported TensorFlow and Lingvo (--fork_tasks=false: '
                   'a fresh interpreter each)')
    for task in self.tasks:
      self.Start(task)

  def _Answers(self, task: Task) -> bool:
    try:
      with socket.create_connection(
          (cluster.Host(task.address), cluster.Port(task.address)),
          timeout=1):
        return True
    except OSError:
      return False

  def WaitReady(self) -> None:
    """Waits until every task's port answers; raises if one cannot."""
    pending = list(self.tasks)

    def AllReady():
      for task in list(pending):
        rc = task.proc.poll()
        if rc is not None:
          self._TailOnce()
          raise RuntimeError(
              f'{task.what} exited with {SignalName(rc)} before it was '
              f'ready; the end of its log ({task.log_path}):\n' +
              task_output.LastLines(task.log_path).rstrip())
        if self._Answers(task):
          pending.remove(task)
          task.ready = True
          self.Print(f'launch: {task.what} is ready')
      return not pending

    if not cluster.PollUntil(AllReady, self._ready_timeout_s, 0.2):
      raise TimeoutError(
          'not ready within --ready_timeout_secs=%g: %s' %
          (self._ready_timeout_s, ', '.join(t.what for t in pending)))
    jobs = collections.defaultdict(list)
    for t in sorted(self.tasks, key=lambda t: (t.job, t.task)):
      jobs[t.job].append(t.address)
    self.Print('launch: all %d tasks are serving: %s' %
               (len(self.tasks), cluster.FormatClusterSpec(jobs)))

  def _ProbeLoop(self, stop: threading.Event) -> None:
    """Asks each ready task's server whether it answers (task_health)."""
    every = max(0.2, min(5.0, self._task_timeout_s / 4))
    while not stop.wait(every):
      for task in self.tasks:
        if (task.ready and not task.done and task.proc and
            task.proc.poll() is None and task_health.Answers(
                cluster.Host(task.address), cluster.Port(task.address),
                min(5.0, self._task_timeout_s / 2))):
          task.last_answer = time.monotonic()

  def _CheckHung(self, task: Task) -> None:
    """Kills a ready task silent for --task_timeout_secs (restarted next)."""
    silent = time.monotonic() - task.last_answer
    if not task.ready or task.hung or silent < self._task_timeout_s:
      return
    state = task_health.State(task.proc.pid)
    how = {'T': 'stopped (SIGSTOP)', 'D': 'in uninterruptible I/O',
           'Z': 'a zombie'}.get(state, 'running, not answering')
    task.hung = True
    self.Print(f'launch: {task.what}, pid {task.proc.pid}, has not answered '
               f'for {silent:.0f} s (--task_timeout_secs='
               f'{self._task_timeout_s:g}; it is {how}): killing it.')
    KillGroup(task.proc, signal.SIGKILL)

  def _Oom(self, task: Task, rc: int) -> bool:
    """Whether `task`, ended by SIGKILL, was the kernel's OOM killer's."""
    if rc not in (-signal.SIGKILL, 128 + signal.SIGKILL) or task.hung:
      return False
    now = self.oom_kills(task.cgroup)
    return now is not None and task.oom_kills is not None and (
        now > task.oom_kills)

  def Watch(self, poll_s: float = 0.2) -> int:
    """Restarts dead tasks until training ends; returns the exit code."""
    stop = threading.Event()
    threading.Thread(target=self._ProbeLoop, args=(stop,), daemon=True,
                     name='probe').start()
    try:
      return self._Watch(poll_s)
    finally:
      stop.set()

  def _Watch(self, poll_s: float) -> int:
    while True:
      for task in self.tasks:
        if task.done:
          continue
        rc = task.proc.poll()
        if rc is None:
          task.rss = task_health.RssBytes(task.proc.pid) or task.rss
          if not task.ready and self._Answers(task):
            task.ready = True
            task.last_answer = time.monotonic()
            self.Print(f'launch: {task.what} is ready')
          loss = elastic.NotBack(
              task.job, task.task, task.restarts > 0, task.ready,
              time.monotonic() - task.started_at, self._ready_timeout_s)
          if loss:
            KillGroup(task.proc, signal.SIGKILL)
            return self._LostForGood(task, loss)
          self._CheckHung(task)
          continue
        self._TailOnce()  # Its last lines first.
        if rc == 0:
          # A client at --max_steps; a worker or ps the chief told so.
          task.done = True
          self.Print(f'launch: {task.what} finished')
          continue
        if rc == EXIT_DISK_FULL:
          self.Print(f'launch: {task.what} stopped: the disk is full (exit '
                     f'{rc}; its error line above): stopping the cluster. '
                     'Free space and run the same command.')
          return EXIT_DISK_FULL
        if rc in NOT_RESTARTED:
          self.Print(f'launch: {task.what} failed: {NOT_RESTARTED[rc]} (exit '
                     f'{rc}; its error line above): not restarting it (it '
                     'would fail again); stopping the cluster. Fix what the '
                     'line says and run the same command.')
          return rc
        if self._Oom(task, rc):
          limit = task_health.MemoryLimit(task.cgroup)
          limit = f', the cgroup\'s limit {task_health.FormatBytes(limit)}' \
              if limit else ''
          self.Print(f'launch: {task.what}, pid {task.proc.pid}, was killed '
                     'by the kernel\'s OOM killer (its last RSS '
                     f'{task_health.FormatBytes(task.rss)}{limit}): not '
                     'restarting it (it would run out again); stopping the '
                     'cluster. Give it more memory or a plan that needs '
                     'less (docs/faults.md), then run the same command.')
          return EXIT_OOM
        loss = elastic.LostForGood(task.job, task.task, SignalName(rc),
                                   self.restarts, self._max_restarts)
        if loss and self._elastic and task.job == 'worker':
          return self._LostForGood(task, loss)
        if loss:
          self.Print(f'launch: {task.what} exited with {SignalName(rc)}; '
                     f'already restarted {self.restarts} task(s) '
                     f'(--max_restarts={self._max_restarts}): giving up. The '
                     f'end of its log ({task.log_path}):\n' +
                     task_output.LastLines(task.log_path).rstrip())
          return 1
        self.restarts += 1
        task.restarts += 1
        gone = 'was killed, hung' if task.hung else 'is gone'
        self.Print(f'launch: {task.what}, pid {task.proc.pid}, {gone} '
                   f'({SignalName(rc)}); restarting it (restart '
                   f'{self.restarts} of --max_restarts={self._max_restarts}); '
                   'training resumes from the last checkpoint. The end of '
                   f'its log ({task.log_path}):\n' +
                   task_output.LastLines(task.log_path, 3).rstrip())
        self.Start(task)
      # A new controller restores the last checkpoint (its own server's
      # variables are new), so the step may fall back below --max_steps: a
      # trainer client that finished since must train again.
      for controller in [t for t in self.tasks if t.job == 'controller']:
        for t in self.tasks:
          if (t.job == 'trainer_client' and t.done and not controller.done and
              controller.started_at > t.started_at):
            t.done = False
            self.Print(f'launch: restarting {t.what}: the restarted '
                       'controller restores the last checkpoint.')
            self.Start(t)
      if all(t.done for t in self.tasks if t.job in CLIENT_JOBS):
        self._AwaitServers()
        self.Print('launch: training finished' + (
            '.' if all(t.done for t in self.tasks) else
            '; stopping the workers.'))
        return 0
      time.sleep(poll_s)

  def _LostForGood(self, task: Task, loss: elastic.Loss) -> int:
    """EXIT_LOST for an elastic cluster's worker; else gives up (1)."""
    self.lost, self.lost_at = loss, time.monotonic()
    if self._elastic and task.job == 'worker':
      return EXIT_LOST  # launching.py says what becomes of it.
    self.Print(f'launch: {task.what} is lost for good ({loss.why}): giving '
               f'up. The end of its log ({task.log_path}):\n' +
               task_output.LastLines(task.log_path, 3).rstrip())
    return 1

  def _AwaitServers(self, timeout_s: float = 10) -> None:
    """Lets the servers a finished chief told 'done' exit on their own."""
    if not any(t.job == 'chief' for t in self.tasks):
      return  # Separate controller and trainer client: nobody tells them.

    def AllDone():
      for t in [t for t in self.tasks if not t.done]:
        if t.proc.poll() == 0:
          self._TailOnce()
          t.done = True
          self.Print(f'launch: {t.what} finished')
      return all(t.done for t in self.tasks)

    cluster.PollUntil(AllDone, timeout_s, 0.2)

  def Shutdown(self, signum: int, grace_s: float,
               preempted_code: int = 0) -> bool:
    """Forwards stop signal `signum` to every task; waits for the save.

    Each task stops safely (runtime/shutdown.py): the controller saves
    the current step, the workers serve until the clients have exited.
    Returns whether the controller (or chief) saved its last step: it
    exited 0 (or `preempted_code`), or had finished before.
    """
    live = [t for t in self.tasks if t.proc and t.proc.poll() is None]
    self.Print(f'launch: {signal.Signals(signum).name}: stopping safely: '
               f'sent it to {len(live)} task(s); waiting up to {grace_s:g} s '
               '(--shutdown_grace_secs) for the last checkpoint.')
    for t in live:
      KillGroup(t.proc, signum)
    clients = [t for t in self.tasks if t.job in ('controller', 'chief')]
    cluster.PollUntil(
        lambda: all(t.proc.poll() is not None for t in self.tasks),
        grace_s + 5, 0.1)  # Each task exits by its own deadline.
    self._TailOnce()
    saved = all(t.done or t.proc.poll() in (0, preempted_code)
                for t in clients)
    self.Print('launch: the last checkpoint was saved.' if saved else
               'launch: the controller did not save the last step; the last '
               'complete checkpoint is the latest.')
    return saved

  def SaveAfterInputFault(self, grace_s: float) -> None:
    """Input broke (exit 65): the controller saves (SIGTERM), then exits."""
    clients = [t for t in self.tasks if t.job in ('controller', 'chief') and
               t.proc and t.proc.poll() is None]
    for t in clients:
      KillGroup(t.proc, signal.SIGTERM)
    cluster.PollUntil(lambda: all(t.proc.poll() is not None for t in clients),
                      grace_s + 5, 0.1)
    self._TailOnce()

  def StopAll(self, grace_s: float = 10) -> None:
    """Stops every process this launcher started."""
    live = [t for t in self.tasks if t.proc and t.proc.poll() is None]
    for t in live:
      KillGroup(t.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for t in live:
      try:
        t.proc.wait(max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        KillGroup(t.proc, signal.SIGKILL)
        t.proc.wait(10)
    for t in self.tasks:
      if t.proc:
        # The group may hold children of a task that already exited.
        KillGroup(t.proc, signal.SIGKILL)
    if self._fork_server and self._fork_server is not self._shared_server:
      self._fork_server.Close()
    self._stop_tail.set()
    self._tail.join(5)
    self._TailOnce()
    task_output.CloseErrorPipes(self.tasks, self._pipes)


def KillGroup(proc, sig: int) -> None:
  """Sends `sig` to the process group of `proc` (gone or not)."""
  try:
    os.killpg(proc.pid, sig)
  except ProcessLookupError:
    pass
  except PermissionError:
    pass
