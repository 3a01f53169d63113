"""Starts, watches and stops a local TensorFlow cluster of trainer processes.

`lingvo_ext.launch` is the command line; `Launch` does the work:

1. picks free ports on 127.0.0.1 and makes the --cluster_spec of a
   controller, a trainer_client and --workers worker tasks;
2. runs each as `python -m lingvo_ext.trainer --cluster_spec=... --job=J
   --task=N` plus the user's trainer flags, in its own process group, and
   streams its output prefixed with its name (also kept in
   LOGDIR/launch/NAME.log);
3. waits (--ready_timeout_secs) until every task's port answers;
4. restarts a task that dies (at most --max_restarts times in all): the
   controller restores the weights of the last checkpoint when it finds
   variables uninitialized on a fresh worker, keeping the step counter where
   training was (trainer_lib.StepKeepingRestore); the trainer client retries
   its step;
5. ends when the trainer client and the controller exit 0 (training reached
   --max_steps), stopping the workers; on Ctrl-C, on a failure it cannot
   restart, or when a task fails to come up, stops every process it started
   and exits non-zero.

TensorFlow's gRPC server listens on every interface of its host (it binds
the wildcard address; TensorFlow has no option for a bind address) and does
no authentication. So by default (--network=private) the launcher first
moves itself into a new network namespace that has only a loopback
interface: its tasks talk over 127.0.0.1 and nothing outside can connect to
them. --network=host skips that (for systems without namespaces) and warns.
"""

import ctypes
import dataclasses
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from lingvo_ext.distributed import cluster

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


def ClusterJobs(num_workers: int, host: str = '127.0.0.1') -> Dict[str, List[str]]:
  """{job: [host:port]} of a local cluster with free ports."""
  ports = FreePorts(num_workers + 2, host)
  return {
      'controller': [f'{host}:{ports[0]}'],
      'trainer_client': [f'{host}:{ports[1]}'],
      'worker': [f'{host}:{p}' for p in ports[2:]],
  }


def TaskCommand(jobs: Dict[str, List[str]], job: str, task: int,
                trainer_flags: Sequence[str]) -> List[str]:
  """The trainer command line of one task of the cluster `jobs`."""
  # --logtostderr: the launcher streams each task's log and keeps it in
  # LOGDIR/launch/NAME.log (the trainer's own log file is per job, and the
  # workers share a job).
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
  proc: Optional[subprocess.Popen] = None
  thread: Optional[threading.Thread] = None
  log: Optional[object] = None
  done: bool = False  # Exited 0 at the end of training.
  started_at: float = 0.0

  @property
  def name(self) -> str:
    return self.job if self.job != 'worker' else f'worker{self.task}'

  @property
  def what(self) -> str:
    return f'{self.job} task {self.task} ({self.address})'


class Launcher:
  """Runs the tasks of one local cluster; see the module docstring."""

  def __init__(self, jobs: Dict[str, List[str]], trainer_flags: Sequence[str],
               logdir: str, ready_timeout_s: float, max_restarts: int,
               out=None):
    self._jobs = jobs
    self._out = out or sys.stdout
    self._lock = threading.Lock()
    self._logdir = os.path.join(logdir, 'launch')
    os.makedirs(self._logdir, exist_ok=True)
    self._ready_timeout_s = ready_timeout_s
    self._max_restarts = max_restarts
    self.restarts = 0
    self.tasks = []
    # Workers first: the clients wait for them.
    for job in ('worker', 'controller', 'trainer_client'):
      for t, address in enumerate(jobs[job]):
        self.tasks.append(
            Task(job, t, address, TaskCommand(jobs, job, t, trainer_flags)))

  def Print(self, line: str) -> None:
    with self._lock:
      self._out.write(line if line.endswith('\n') else line + '\n')
      self._out.flush()

  def _Stream(self, task: Task, proc: subprocess.Popen, log) -> None:
    prefix = f'[{task.name}] '
    for line in proc.stdout:
      log.write(line)
      log.flush()
      self.Print(prefix + line)

  def Start(self, task: Task) -> None:
    log = open(os.path.join(self._logdir, f'{task.name}.log'), 'a')
    task.proc = subprocess.Popen(
        task.argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors='replace',
        bufsize=1,
        start_new_session=True)  # Its own process group, to stop it whole.
    task.log = log
    task.started_at = time.monotonic()
    task.thread = threading.Thread(
        target=self._Stream, args=(task, task.proc, log), daemon=True)
    task.thread.start()
    self.Print(f'launch: started {task.what} as pid {task.proc.pid}')

  def StartAll(self) -> None:
    for task in self.tasks:
      self.Start(task)

  def WaitReady(self) -> None:
    """Waits until every task's port answers; raises if one cannot."""
    deadline = time.monotonic() + self._ready_timeout_s
    pending = list(self.tasks)
    while pending:
      for task in list(pending):
        rc = task.proc.poll()
        if rc is not None:
          raise RuntimeError(
              f'{task.what} exited with {_SignalName(rc)} before it was '
              f'ready; see its log above or in {self._logdir}.')
        try:
          with socket.create_connection(
              (cluster.Host(task.address), cluster.Port(task.address)),
              timeout=1):
            pending.remove(task)
        except OSError:
          pass
      if pending and time.monotonic() > deadline:
        raise TimeoutError(
            'not ready within --ready_timeout_secs=%g: %s' %
            (self._ready_timeout_s, ', '.join(t.what for t in pending)))
      time.sleep(0.2)
    self.Print('launch: all %d tasks are serving: %s' %
               (len(self.tasks), cluster.FormatClusterSpec(self._jobs)))

  def Watch(self, poll_s: float = 0.2) -> int:
    """Restarts dead tasks until training ends; returns the exit code."""
    while True:
      for task in self.tasks:
        if task.done:
          continue
        rc = task.proc.poll()
        if rc is None:
          continue
        task.thread.join(5)  # Its last lines.
        if rc == 0 and task.job in ('controller', 'trainer_client'):
          task.done = True
          self.Print(f'launch: {task.what} finished')
          continue
        if self.restarts >= self._max_restarts:
          self.Print(f'launch: {task.what} exited with {_SignalName(rc)}; '
                     f'already restarted {self.restarts} task(s) '
                     f'(--max_restarts={self._max_restarts}): giving up.')
          return 1
        self.restarts += 1
        self.Print(f'launch: {task.what}, pid {task.proc.pid}, is gone '
                   f'({_SignalName(rc)}); restarting it (restart '
                   f'{self.restarts} of --max_restarts={self._max_restarts}); '
                   'training resumes from the last checkpoint.')
        self.Start(task)
      # A new controller restores the last checkpoint (its own server's
      # variables are new), so the step may fall back below --max_steps: a
      # trainer client that finished since must train again.
      controller = [t for t in self.tasks if t.job == 'controller'][0]
      for t in self.tasks:
        if (t.job == 'trainer_client' and t.done and not controller.done and
            controller.started_at > t.started_at):
          t.done = False
          self.Print(f'launch: restarting {t.what}: the restarted controller '
                     'restores the last checkpoint.')
          self.Start(t)
      if all(t.done for t in self.tasks if t.job != 'worker'):
        self.Print('launch: training finished; stopping the workers.')
        return 0
      time.sleep(poll_s)

  def StopAll(self, grace_s: float = 10) -> None:
    """Stops every process this launcher started, then their log threads."""
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
      if t.thread:
        t.thread.join(5)
      if t.log:
        t.log.close()


def _KillGroup(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except ProcessLookupError:
    pass
  except PermissionError:
    pass


def Launch(num_workers: int, trainer_flags: Sequence[str], logdir: str,
           network: str = 'private', ready_timeout_s: float = 120,
           max_restarts: int = 3, out=None) -> int:
  """Runs a local cluster until training ends; returns the exit code."""
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
  jobs = ClusterJobs(num_workers)
  launcher = Launcher(jobs, trainer_flags, logdir, ready_timeout_s,
                      max_restarts, out)
  interrupted = []

  def OnSignal(signum, frame):
    del frame
    interrupted.append(signum)
    raise KeyboardInterrupt

  old = signal.signal(signal.SIGTERM, OnSignal)
  try:
    launcher.StartAll()
    launcher.WaitReady()
    return launcher.Watch()
  except KeyboardInterrupt:
    Say('launch: interrupted; stopping every task.')
    return 130
  except (RuntimeError, TimeoutError) as e:
    Say(f'error: {e}')
    return 1
  finally:
    launcher.StopAll()
    signal.signal(signal.SIGTERM, old)
    Say('launch: stopped all %d processes.' % len(launcher.tasks))
