"""Starts, watches and stops a local TensorFlow cluster of trainer processes.

`lingvo_ext.launch` is the command line; `Launch` does the work:

1. picks free ports on 127.0.0.1 and tells each task its place in the
   cluster, as --cluster_from says: flags (default: --cluster_spec, --job,
   --task; a controller, a trainer client, the workers), tf_config (a
   TF_CONFIG variable per task and --cluster_resolver=tf_config, as
   Kubernetes operators do: a chief running the controller and trainer
   client, the workers) or slurm (SLURM_* variables as srun sets them for
   --nodes nodes, 127.0.0.1, 127.0.0.2, ..., and --cluster_resolver=slurm);
   --ps adds ps tasks, which then hold the variables;
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
   line of every task, prefixed with its name;
4. waits (--ready_timeout_secs) until every task's port answers;
5. restarts a task that dies (at most --max_restarts times in all): the
   controller restores the weights of the last checkpoint when it finds
   variables uninitialized on a fresh worker, keeping the step counter where
   training was (step_keeping.StepKeepingRestore); the trainer client retries
   its step;
6. ends when the clients (controller and trainer client, or the chief) exit
   0 (training reached --max_steps), stopping the workers; on Ctrl-C, on a
   failure it cannot restart, or when a task fails to come up, stops every
   process it started and exits non-zero.

TensorFlow's gRPC server listens on every interface of its host (it binds
the wildcard address; TensorFlow has no option for a bind address) and does
no authentication. So by default (--network=private) the launcher first
moves itself into a new network namespace that has only a loopback
interface: its tasks talk over 127.0.0.1 and nothing outside can connect to
them. --network=host skips that (for systems without namespaces) and warns.
"""

import collections
import ctypes
import dataclasses
import fcntl
import os
import random
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import fork_server
from lingvo_ext.distributed import resolvers
from lingvo_ext.distributed import task_health

CLUSTER_FROM = ('flags', 'tf_config', 'slurm')
EXIT_STOPPED = 0
EXIT_NOT_SAVED = 143
# A task's exit status for a full disk (runtime/disk_space.py: EX_IOERR).
EXIT_DISK_FULL = 74
# The launcher's exit status when the kernel's OOM killer ended a task.
EXIT_OOM = 137
# Exits that the same task would repeat if restarted: the launcher stops the
# cluster with that status. 2: bad flags, params or input (trainer.py);
# 4: an evaler's or decoder's evaluation failed (local_evaler.py); 65: the
# input files broke during the run (tasks/input_files.py).
NOT_RESTARTED = {2: 'it refused its input', 4: 'its evaluation failed',
                 65: 'its input files broke'}
# Jobs whose exit 0 means training is done.
CLIENT_JOBS = ('controller', 'trainer_client', 'chief')

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def EnterPrivateNetwork() -> None:
  """Moves this process into a new network namespace with only loopback.

  Must be called before any thread starts (unshare(CLONE_NEWUSER) fails in a
  multi-threaded process). Children inherit the namespace.

  Raises:
    OSError: if the kernel or its policy does not allow it.
  """
  libc = ctypes.CDLL(None, use_errno=True)
  uid, gid = os.getuid(), os.getgid()
  if libc.unshare(_CLONE_NEWNET) != 0:
    # Without CAP_SYS_ADMIN: a user namespace gives it, for this namespace.
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
      e = ctypes.get_errno()
      raise OSError(e, os.strerror(e))
    with open('/proc/self/setgroups', 'w') as f:
      f.write('deny')
    with open('/proc/self/uid_map', 'w') as f:
      f.write(f'{uid} {uid} 1')
    with open('/proc/self/gid_map', 'w') as f:
      f.write(f'{gid} {gid} 1')
  # A new namespace's loopback interface is down: bring it up.
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    ifr = struct.pack('16sh', b'lo', 0)
    flags = struct.unpack('16sh', fcntl.ioctl(s, _SIOCGIFFLAGS, ifr))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack('16sh', b'lo', flags | _IFF_UP))


def FreePorts(n: int, host: str = '127.0.0.1') -> List[int]:
  """n distinct ports that are free on `host` now."""
  socks = []
  try:
    for _ in range(n):
      s = socket.socket()
      s.bind((host, 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def FreePortRange(n: int, host: str = '127.0.0.1', tries: int = 100) -> int:
  """The first of n consecutive ports that are free on `host` now."""
  for _ in range(tries):
    base = random.randint(20000, 60000 - n)
    try:
      socks = []
      for p in range(base, base + n):
        s = socket.socket()
        socks.append(s)
        s.bind((host, p))
      return base
    except OSError:
      pass
    finally:
      for s in socks:
        s.close()
  raise RuntimeError(f'found no {n} consecutive free ports on {host}.')


def ClusterJobs(num_workers: int, host: str = '127.0.0.1',
                num_ps: int = 0) -> Dict[str, List[str]]:
  """{job: [host:port]} of a local cluster with free ports."""
  ports = FreePorts(num_workers + num_ps + 2, host)
  jobs = {
      'controller': [f'{host}:{ports[0]}'],
      'trainer_client': [f'{host}:{ports[1]}'],
      'worker': [f'{host}:{p}' for p in ports[2:2 + num_workers]],
  }
  if num_ps:
    jobs['ps'] = [f'{host}:{p}' for p in ports[2 + num_workers:]]
  return jobs


def TaskCommand(jobs: Dict[str, List[str]], job: str, task: int,
                trainer_flags: Sequence[str]) -> List[str]:
  """The trainer command line of one task of the cluster `jobs`."""
  # --logtostderr: the task's whole log goes to its LOGDIR/launch file (the
  # trainer's own log file is per job, and the workers share a job).
  return [
      sys.executable, '-m', 'lingvo_ext.trainer',
      f'--cluster_spec={cluster.FormatClusterSpec(jobs)}', '--mode=sync',
      f'--job={job}', f'--task={task}', '--logtostderr', *trainer_flags
  ]


def _SignalName(rc: int) -> str:
  if rc < 0:
    try:
      return f'signal {signal.Signals(-rc).name}'
    except ValueError:
      return f'signal {-rc}'
  return f'exit code {rc}'


@dataclasses.dataclass
class Task:
  """One process of the cluster."""
  job: str
  task: int
  address: str
  argv: List[str]
  env: Dict[str, str] = dataclasses.field(default_factory=dict)
  # subprocess.Popen, or fork_server.ForkedProcess.
  proc: Optional[subprocess.Popen] = None
  done: bool = False  # Exited 0 at the end of training.
  ready: bool = False
  started_at: float = 0.0
  log_path: str = ''
  log_pos: int = 0  # Bytes of the log already read.
  partial: bytes = b''
  last_answer: float = 0.0  # time.monotonic() of its last answer.
  hung: bool = False  # Killed by the launcher for not answering.
  rss: Optional[int] = None  # Its last resident memory seen.
  cgroup: Optional[str] = None  # Its memory cgroup's directory.
  oom_kills: Optional[int] = None  # The cgroup's OOM kills at its start.

  @property
  def name(self) -> str:
    return self.job if self.job != 'worker' else f'worker{self.task}'

  @property
  def what(self) -> str:
    return f'{self.job} task {self.task} ({self.address})'


def ClusterTasks(num_workers: int, trainer_flags: Sequence[str],
                 cluster_from: str = 'flags', num_ps: int = 0,
                 nodes: int = 1, host: str = '127.0.0.1') -> List[Task]:
  """The tasks of a local cluster, told their place as `cluster_from` says.

  Args:
    num_workers: Worker tasks.
    trainer_flags: The user's trainer flags, passed to every task.
    cluster_from: 'flags', 'tf_config' or 'slurm' (see the module doc).
    num_ps: ps tasks ('flags' and 'tf_config').
    nodes: 'slurm': the step's nodes; node n is 127.0.0.(n+1).
    host: 'flags' and 'tf_config': every task's host.

  Returns:
    Workers and ps first (the clients wait for them), then the clients.
  """
  tail = ['--mode=sync', '--logtostderr', *trainer_flags]
  trainer = [sys.executable, '-m', 'lingvo_ext.trainer']
  tasks = []
  if cluster_from == 'flags':
    jobs = ClusterJobs(num_workers, host, num_ps)
    for job in ('worker', 'ps', 'controller', 'trainer_client'):
      for t, address in enumerate(jobs.get(job, ())):
        tasks.append(Task(job, t, address, TaskCommand(jobs, job, t,
                                                       trainer_flags)))
    return tasks
  if cluster_from == 'tf_config':
    ports = FreePorts(1 + num_workers + num_ps, host)
    spec = {'chief': [f'{host}:{ports[0]}'],
            'worker': [f'{host}:{p}' for p in ports[1:1 + num_workers]]}
    if num_ps:
      spec['ps'] = [f'{host}:{p}' for p in ports[1 + num_workers:]]
    argv = trainer + ['--cluster_resolver=tf_config', *tail]
    for job in ('worker', 'ps', 'chief'):
      for t, address in enumerate(spec.get(job, ())):
        tasks.append(Task(job, t, address, argv,
                          {'TF_CONFIG': resolvers.TFConfig(spec, job, t)}))
    return tasks
  if cluster_from == 'slurm':
    hosts = [f'127.0.0.{n + 1}' for n in range(nodes)]
    # The chief (rank 0) on the first node, then the workers in order.
    per_node = [num_workers // nodes] * nodes
    per_node[0] += 1
    base = FreePortRange(1 + num_workers)
    argv = trainer + ['--cluster_resolver=slurm',
                      f'--slurm_port_base={base}', *tail]
    for rank in range(1 + num_workers):
      env = resolvers.SlurmEnv(hosts, per_node, rank)
      # What resolvers.FromSlurm makes of it (without importing TensorFlow
      # here): rank 0 the chief, rank 1+i worker i, port base + rank.
      address = f'{env["SLURMD_NODENAME"]}:{base + rank}'
      tasks.append(Task('chief' if rank == 0 else 'worker', max(rank - 1, 0),
                        address, argv, env))
    return tasks[1:] + tasks[:1]
  raise ValueError(f'--cluster_from={cluster_from} is not one of '
                   f'{", ".join(CLUSTER_FROM)}.')


# Lines of a task's log shown without --stream_logs: the trainer's progress
# line and the tasks' own one-line messages (not Lingvo's and TensorFlow's
# INFO log records).
_SHOWN = re.compile(
    r'^(step \d+/\d+ |error:|warning:|note:|interrupted|TF_CONFIG:|Slurm:|'
    r'(controller|trainer_client|trainer|worker|ps|evaler_\w+|decoder_\w+)'
    r'(,\w+)*( task \d+)?:)')


class _Output:
  """Writes lines to `out` from a thread of its own.

  Put never blocks: when the reader is slow and --stream_logs lines pile up
  beyond max_lines, the newest task lines are dropped (and counted); the
  launcher's own lines are always kept.
  """

  def __init__(self, out, logdir: str, max_lines: int = 20000):
    self._out = out
    self._logdir = logdir
    self._max = max_lines
    self._lines = collections.deque()
    self._dropped = 0
    self._busy = False
    self._cv = threading.Condition()
    threading.Thread(target=self._Run, daemon=True, name='output').start()

  def Put(self, line: str, keep: bool = True) -> None:
    with self._cv:
      if not keep and len(self._lines) >= self._max:
        self._dropped += 1
        return
      self._lines.append(line if line.endswith('\n') else line + '\n')
      self._cv.notify_all()

  def _Run(self):
    while True:
      with self._cv:
        while not self._lines:
          self._busy = False
          self._cv.notify_all()
          self._cv.wait()
        self._busy = True
        line = self._lines.popleft()
        dropped, self._dropped = self._dropped, 0
      try:
        if dropped:
          self._out.write(f'launch: {dropped} log line(s) not shown (the '
                          'output is read slowly); every line is in '
                          f'{self._logdir}\n')
        self._out.write(line)
        self._out.flush()
      except (OSError, ValueError):
        pass  # A closed reader: the logs still have every line.

  def Flush(self, timeout_s: float = 5) -> None:
    """Waits (at most timeout_s) until every line is written."""
    deadline = time.monotonic() + timeout_s
    with self._cv:
      while self._lines or self._busy:
        left = deadline - time.monotonic()
        if left <= 0:
          return
        self._cv.wait(left)


class Launcher:
  """Runs the tasks of one local cluster; see the module docstring."""

  def __init__(self, tasks: List[Task], logdir: str, ready_timeout_s: float,
               max_restarts: int, out=None, stream_logs: bool = False,
               fork_tasks: bool = True, task_timeout_s: float = 60):
    self._logdir = os.path.join(logdir, 'launch')
    self._task_timeout_s = task_timeout_s
    # The cgroup's OOM kill count (task_health.OomKills; tests replace it).
    self.oom_kills = task_health.OomKills
    self._fork_tasks = fork_tasks
    self._fork_server = None
    os.makedirs(self._logdir, exist_ok=True)
    self._output = _Output(out or sys.stdout, self._logdir)
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
        if not task.log_path or not os.path.exists(task.log_path):
          continue
        with open(task.log_path, 'rb') as f:
          f.seek(task.log_pos)
          data = f.read(1 << 22)
        task.log_pos += len(data)
        lines = (task.partial + data).split(b'\n')
        task.partial = lines.pop()
        for raw in lines:
          line = raw.decode('utf-8', 'replace')
          if self._stream_logs:
            self._output.Put(f'[{task.name}] {line}', keep=False)
          elif _SHOWN.match(line):
            self._output.Put(f'[{task.name}] {line}')

  def _TailLoop(self) -> None:
    while not self._stop_tail.wait(0.2):
      try:
        self._TailOnce()
      except OSError:
        pass

  def Start(self, task: Task) -> None:
    """Starts `task`; call from the main thread only (PR_SET_PDEATHSIG is
    tied to the thread that forks)."""
    env = dict(os.environ, **task.env)
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
              preexec_fn=fork_server.DieWithParent(os.getpid()),
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
    if self._fork_tasks:
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

  def _LastLines(self, task: Task, n: int = 8) -> str:
    try:
      with open(task.log_path, 'rb') as f:
        f.seek(max(0, os.path.getsize(task.log_path) - 16384))
        lines = f.read().decode('utf-8', 'replace').splitlines()
    except OSError:
      return ''
    return ''.join(f'  | {l}\n' for l in lines[-n:])

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
              f'{task.what} exited with {_SignalName(rc)} before it was '
              f'ready; the end of its log ({task.log_path}):\n' +
              self._LastLines(task).rstrip())
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
    _KillGroup(task.proc, signal.SIGKILL)

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
        if self.restarts >= self._max_restarts:
          self.Print(f'launch: {task.what} exited with {_SignalName(rc)}; '
                     f'already restarted {self.restarts} task(s) '
                     f'(--max_restarts={self._max_restarts}): giving up. The '
                     f'end of its log ({task.log_path}):\n' +
                     self._LastLines(task).rstrip())
          return 1
        self.restarts += 1
        gone = 'was killed, hung' if task.hung else 'is gone'
        self.Print(f'launch: {task.what}, pid {task.proc.pid}, {gone} '
                   f'({_SignalName(rc)}); restarting it (restart '
                   f'{self.restarts} of --max_restarts={self._max_restarts}); '
                   'training resumes from the last checkpoint. The end of '
                   f'its log ({task.log_path}):\n' +
                   self._LastLines(task, 3).rstrip())
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

  def Shutdown(self, signum: int, grace_s: float) -> bool:
    """Forwards stop signal `signum` to every task; waits for the save.

    Each task stops safely (runtime/shutdown.py): the controller saves
    the current step, the workers serve until the clients have exited.
    Returns whether the controller (or chief) saved its last step: it
    exited 0, or had finished before.
    """
    live = [t for t in self.tasks if t.proc and t.proc.poll() is None]
    self.Print(f'launch: {signal.Signals(signum).name}: stopping safely: '
               f'sent it to {len(live)} task(s); waiting up to {grace_s:g} s '
               '(--shutdown_grace_secs) for the last checkpoint.')
    for t in live:
      _KillGroup(t.proc, signum)
    clients = [t for t in self.tasks if t.job in ('controller', 'chief')]
    cluster.PollUntil(
        lambda: all(t.proc.poll() is not None for t in self.tasks),
        grace_s + 5, 0.1)  # Each task exits by its own deadline.
    self._TailOnce()
    saved = all(t.done or t.proc.poll() == 0 for t in clients)
    self.Print('launch: the last checkpoint was saved.' if saved else
               'launch: the controller did not save the last step; the last '
               'complete checkpoint is the latest.')
    return saved

  def StopAll(self, grace_s: float = 10) -> None:
    """Stops every process this launcher started."""
    live = [t for t in self.tasks if t.proc and t.proc.poll() is None]
    for t in live:
      _KillGroup(t.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for t in live:
      try:
        t.proc.wait(max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        _KillGroup(t.proc, signal.SIGKILL)
        t.proc.wait(10)
    for t in self.tasks:
      if t.proc:
        # The group may hold children of a task that already exited.
        _KillGroup(t.proc, signal.SIGKILL)
    if self._fork_server:
      self._fork_server.Close()
    self._stop_tail.set()
    self._tail.join(5)
    self._TailOnce()


def _KillGroup(proc, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except ProcessLookupError:
    pass
  except PermissionError:
    pass


def Launch(num_workers: int, trainer_flags: Sequence[str], logdir: str,
           network: str = 'private', ready_timeout_s: float = 120,
           max_restarts: int = 3, out=None, stream_logs: bool = False,
           cluster_from: str = 'flags', num_ps: int = 0, nodes: int = 1,
           layout: Optional[cluster.WorkerLayout] = None,
           fork_tasks: bool = True, shutdown_grace_s: float = 20,
           task_timeout_s: float = 60) -> int:
  """Runs a local cluster until training ends; returns the exit code.

  Exit codes: 0 training finished, or stopped by SIGTERM/SIGHUP after the
  controller saved the last step; 1 a task failed; 2 bad flags, or a task
  refused its input; 4 an evaluation failed; 65 input files broke; 74 a task
  found the disk full; 130 Ctrl-C; 137 the OOM killer ended a task; 143
  SIGTERM/SIGHUP without the last save (docs/preemption.md,
  docs/faults.md).
  """
  out = out or sys.stdout

  def Say(line):
    out.write(line + '\n')
    out.flush()

  if network == 'private':
    try:
      EnterPrivateNetwork()
    except OSError as e:
      Say(f'error: --network=private: cannot make a private network '
          f'namespace here ({e}); run with --network=host to run the cluster '
          'on this host\'s network (its gRPC ports then accept connections '
          'from every interface).')
      return 2
    Say('launch: TensorFlow\'s gRPC servers listen on all interfaces; this '
        'cluster runs in a private network namespace with only 127.0.0.1, so '
        'nothing outside this launcher can reach its ports.')
  else:
    Say('launch: WARNING --network=host: TensorFlow\'s gRPC servers listen on '
        'all interfaces of this host and do no authentication; anyone who can '
        'reach these ports can run code in these processes.')
  if layout:
    Say('launch: %d replica(s) x %d cell(s): %s' % (
        layout.num_replicas, layout.split_size, '; '.join(
            f'replica {r} cell {i} on {layout.Device(r, i)}'
            for r in range(layout.num_replicas)
            for i in range(layout.split_size))))
  tasks = ClusterTasks(num_workers, trainer_flags, cluster_from, num_ps, nodes)
  launcher = Launcher(tasks, logdir, ready_timeout_s, max_restarts, out,
                      stream_logs, fork_tasks, task_timeout_s)
  interrupted = []

  def OnSignal(signum, frame):
    del frame
    interrupted.append(signum)
    if len(interrupted) > 1:  # A second signal: stop everything at once.
      for t in tasks:
        if t.proc:
          _KillGroup(t.proc, signal.SIGKILL)
      raise KeyboardInterrupt
    raise KeyboardInterrupt

  old = {s: signal.signal(s, OnSignal) for s in (signal.SIGTERM,
                                                  signal.SIGHUP)}
  try:
    try:
      launcher.StartAll()
      launcher.WaitReady()
      return launcher.Watch()
    except KeyboardInterrupt:
      signum = interrupted[0] if interrupted else signal.SIGINT
      try:
        saved = launcher.Shutdown(signum, shutdown_grace_s)
      except KeyboardInterrupt:  # A second signal: stopped at once.
        saved = False
      if signum == signal.SIGINT:
        return 130
      return EXIT_STOPPED if saved else EXIT_NOT_SAVED
  except (RuntimeError, TimeoutError) as e:
    launcher.Print(f'error: {e}')
    return 1
  finally:
    launcher.StopAll()
    for s, handler in old.items():
      signal.signal(s, handler)
    launcher.Print('launch: stopped all %d processes.' % len(launcher.tasks))
    launcher.Flush()
