"""Trainer tasks forked from one process that has imported TensorFlow once.

A `python -m lingvo_ext.trainer` task spends about 4 CPU-seconds importing
TensorFlow and Lingvo before it does anything else, and a local cluster
starts several at once (and again on every restart). `lingvo_ext.launch`
instead starts one server process (`python -m
lingvo_ext.distributed.fork_server MODULE...`) that imports what the MODULEs
import (not the modules themselves: the trainer defines its absl flags at
import, and `python -m` runs it afresh as __main__), then forks each task
from it. The task runs its MODULE as __main__ with its own argv,
environment, working folder and output files, in its own process group, as
`python -m` would. The tests' runs of the trainer and tools
(tests/support/zygote.py) are forked by such a server too.

Why forking there is safe:
* TensorFlow starts no thread at import (no op has run in the server; each
  task makes its own eager context and thread pools). The only threads an
  import starts are numpy's OpenBLAS pool: the server imports with
  OPENBLAS_NUM_THREADS=1 (so the tasks' numpy BLAS is single-threaded; the
  trainer's math is TensorFlow's), and it refuses to fork while it has more
  than one thread, in which case the launcher starts a fresh interpreter.
* Variables read at import (IMPORT_ENV) are the server's for every forked
  task: a task whose environment differs in one of them gets a fresh
  interpreter (`Usable`). TF_CONFIG is read when the trainer resolves its
  cluster, not at import.
* Python's `random` reseeds itself after a fork; the task reseeds numpy's
  global generator.
* The task ends as an interpreter does: non-daemon threads joined, atexit
  handlers run, streams flushed, its exit code as SystemExit gives it, 1
  after an uncaught exception (traceback in its log).
* Each task gets PR_SET_PDEATHSIG=SIGKILL against the server, and the
  server against the launcher's thread that started it: however the
  launcher dies, both go with it. The server also kills its tasks and exits
  when the launcher closes its stdin.

The protocol, one JSON object per line: the server writes {"ready": ...}
after its imports; to each request on its stdin ({"module", "argv", "cwd",
"env", "stdout", "stderr", "collect_at_exit"}; stdout and stderr are paths
the task appends to, the same path for one log) it answers {"pid": N} or
{"refused": WHY}, and writes
{"exited": N, "returncode": RC} when task N ends (RC < 0: killed by signal
-RC, as subprocess reports it).
"""

import ast
import ctypes
import gc
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
from typing import Dict, List, Mapping, Optional, Sequence

from lingvo_ext import entry_point  # pylint: disable=unused-import
from lingvo_ext._internal import process

# Environment variables a library may read at import (TF_CONFIG excepted).
IMPORT_ENV = ('TF_', 'OMP_', 'KMP_', 'MKL_', 'CUDA', 'XLA_', 'PYTHON', 'LD_',
              'OPENBLAS_', 'GOTO', 'NPY_', 'JAX_', 'ABSL_')
_READ_AT_RUN_TIME = ('TF_CONFIG',)
# Set in the server only: OpenBLAS then starts no thread.
SERVER_ENV = {'OPENBLAS_NUM_THREADS': '1'}
_PR_SET_PDEATHSIG = 1


def ImportEnv(env: Mapping[str, str]) -> Dict[str, str]:
  """The variables of `env` that a library may read at import.

  Not PYTHONPATH (RunAsMain puts it on sys.path) nor SERVER_ENV's.
  """
  return {k: v for k, v in env.items()
          if k.startswith(IMPORT_ENV) and k not in _READ_AT_RUN_TIME and
          k not in SERVER_ENV and k != 'PYTHONPATH'}


def SitePath() -> List[str]:
  """sys.path past its first entry (the script's folder, or the cwd under
  `python -m`) and PYTHONPATH's: the interpreter's own."""
  n = 1 + len([p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep)
               if p])
  return sys.path[n:]


def Preload(modules: Sequence[str]) -> None:
  """Imports TensorFlow, numpy and what each of `modules` imports.

  Not the modules themselves: each runs afresh as __main__ in its task.
  """
  import numpy  # pylint: disable=g-import-not-at-top,unused-import
  import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
  for module in modules:
    with open(importlib.util.find_spec(module).origin) as f:
      tree = ast.parse(f.read())
    for node in tree.body:
      if isinstance(node, ast.Import):
        for alias in node.names:
          importlib.import_module(alias.name)
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        base = importlib.import_module(node.module)
        for alias in node.names:
          if not hasattr(base, alias.name):  # A submodule.
            importlib.import_module(node.module + '.' + alias.name)


def Fork() -> int:
  """os.fork() as Python's gc docs advise for a server that forks without
  exec: the objects imported so far are frozen (gc.freeze), so the child's
  collections, and the one at its exit, never walk them (that last one
  alone costs a TensorFlow process about a CPU-second) nor copy their
  pages."""
  gc.freeze()
  return os.fork()


def Threads() -> int:
  """This process's threads (forking is safe only with one)."""
  return len(os.listdir('/proc/self/task'))


def DieWithParent(parent_pid: int):
  """A preexec_fn: the child gets SIGKILL when the thread that forked it
  exits, and exits at once if its parent is already gone."""
  prctl = ctypes.CDLL(None, use_errno=True).prctl  # Looked up before fork.

  def Preexec():
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # The parent died before prctl.
      process.ExitNow(1)

  return Preexec


def RunAsMain(module: str, argv: Sequence[str], cwd: str,
              env: Mapping[str, str], stdout_fd: int, stderr_fd: int,
              site_path: Sequence[str], collect_at_exit: bool = True) -> None:
  """In a forked child: runs `module` as __main__ as `python -m` would.

  Call it from the child's top level and let what it raises (SystemExit
  with the module's exit code, or an uncaught exception) end the
  interpreter: the child then exits as `python -m` does, non-daemon threads
  joined, atexit handlers run and objects finalized (TensorFlow's event
  writers flush their files then).

  Args:
    module: The module to run.
    argv: Its arguments (sys.argv[1:]).
    cwd: The working folder.
    env: The whole environment.
    stdout_fd: Becomes fd 1.
    stderr_fd: Becomes fd 2.
    site_path: The server's SitePath() (as the server started).
    collect_at_exit: False: the exit's garbage collection skips what the run
      made (gc.freeze), saving about a CPU-second after a Transformer's
      graphs; objects left in reference cycles are then not finalized
      (tests/support/zygote.py's choice; an object that only its module
      holds still goes as the modules are cleared).
  """
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  os.dup2(stdout_fd, 1)
  os.dup2(stderr_fd, 2)
  os.chdir(cwd)
  os.environ.clear()
  os.environ.update(env)
  # As under `python -m`: the cwd, PYTHONPATH, then the interpreter's own.
  sys.path[:] = [cwd] + [p for p in env.get('PYTHONPATH', '').split(
      os.pathsep) if p] + list(site_path)
  import numpy  # pylint: disable=g-import-not-at-top
  numpy.random.seed()
  import runpy  # pylint: disable=g-import-not-at-top
  sys.argv = ['-m'] + list(argv)
  try:
    runpy.run_module(module, run_name='__main__', alter_sys=True)
  finally:
    if not collect_at_exit:
      gc.freeze()


def ReturnCode(status: int) -> int:
  """A waitpid status as subprocess reports it (-N: killed by signal N)."""
  if os.WIFSIGNALED(status):
    return -os.WTERMSIG(status)
  return os.WEXITSTATUS(status)


# --- The launcher's side -------------------------------------------------------


class ForkedProcess:
  """A task forked by the server: the part of subprocess.Popen we use."""

  def __init__(self, server: 'ForkServer', pid: int, args: Sequence[str]):
    self._server = server
    self.pid = pid
    self.args = list(args)
    self.returncode = None

  def poll(self) -> Optional[int]:  # pylint: disable=invalid-name
    if self.returncode is None:
      self.returncode = self._server.ExitCode(self.pid)
    return self.returncode

  def wait(self, timeout: Optional[float] = None) -> int:  # pylint: disable=invalid-name
    if self.returncode is None:
      rc = self._server.WaitExit(self.pid, timeout)
      if rc is None:
        raise subprocess.TimeoutExpired(self.args, timeout)
      self.returncode = rc
    return self.returncode


class ForkServer:
  """A handle on a fork server for runs of `modules`.

  Start and Spawn must be called from one thread, the one whose exit the
  server and its tasks must not outlive (PR_SET_PDEATHSIG).
  """

  def __init__(self, modules: Sequence[str], log_path: str,
               extra_env: Optional[Mapping[str, str]] = None):
    """Constructor.

    Args:
      modules: The modules it runs (`python -m MODULE`), or one module.
      log_path: The server's own output (appended).
      extra_env: Set in the server's environment, over this process's as
        it is at Start (importing TensorFlow sets variables of its own).
    """
    self.modules = (modules,) if isinstance(modules, str) else tuple(modules)
    self._log_path = log_path
    self._extra_env = dict(extra_env or {})
    self._proc = None
    self._env = None  # The server's, from Start.
    self._cv = threading.Condition()
    self._replies = []  # Answers to requests, in order.
    self._exits = {}  # pid: return code.
    self._alive = set()  # Forked pids not reported yet.
    self._lost = False  # The server's output ended, or it stopped answering.
    self._reader = None

  def Start(self, timeout_s: float) -> Optional[str]:
    """Starts the server; None once it has imported, else why it cannot."""
    self._env = dict(os.environ, **self._extra_env, **SERVER_ENV)
    with open(self._log_path, 'ab') as log:
      self._proc = subprocess.Popen(
          [sys.executable, '-m', __name__, *self.modules],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
          env=self._env, preexec_fn=DieWithParent(os.getpid()),
          start_new_session=True)
    self._reader = threading.Thread(target=self._Read, daemon=True,
                                    name='fork_server')
    self._reader.start()
    reply = self._NextReply(timeout_s)
    if reply is None or 'ready' not in reply:
      self.Close()
      return (f'the fork server did not start within {timeout_s:g} s; see '
              f'{self._log_path}' if reply is None else
              f'the fork server failed; see {self._log_path}')
    return None

  @property
  def pid(self) -> Optional[int]:
    return self._proc.pid if self._proc else None

  def _Read(self) -> None:
    for line in self._proc.stdout:
      try:
        msg = json.loads(line)
      except ValueError:
        continue
      with self._cv:
        if 'exited' in msg:
          self._exits[msg['exited']] = msg['returncode']
          self._alive.discard(msg['exited'])
        else:
          if 'pid' in msg:  # Before its exit can be reported.
            self._alive.add(msg['pid'])
          self._replies.append(msg)
        self._cv.notify_all()
    with self._cv:
      # Its tasks die with it (PR_SET_PDEATHSIG).
      for pid in self._alive:
        self._exits.setdefault(pid, -int(signal.SIGKILL))
      self._alive.clear()
      self._lost = True
      self._cv.notify_all()

  def _NextReply(self, timeout_s: float) -> Optional[dict]:
    with self._cv:
      self._cv.wait_for(lambda: self._replies or self._lost, timeout_s)
      return self._replies.pop(0) if self._replies else None

  def Usable(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether a run of `argv` with `env` can be forked from this server
    (from this process's environment, if not started yet)."""
    return (not self._lost and len(argv) > 2 and
            list(argv[:2]) == [sys.executable, '-m'] and
            argv[2] in self.modules and
            ImportEnv(env) == ImportEnv(self._env or os.environ))

  def Spawn(self, argv: Sequence[str], env: Mapping[str, str],
            log_path: str, stderr_path: Optional[str] = None,
            cwd: Optional[str] = None,
            collect_at_exit: bool = True) -> Optional[ForkedProcess]:
    """Forks a run of `argv`; None if it cannot.

    Args:
      argv: `[sys.executable, '-m', module, args...]`.
      env: Its whole environment.
      log_path: Its stdout, appended to (and its stderr, by default).
      stderr_path: Its stderr, appended to, if not log_path.
      cwd: Its working folder (default: this process's).
      collect_at_exit: See RunAsMain.
    """
    if self._proc is None or not self.Usable(argv, env):
      return None
    request = dict(module=argv[2], argv=list(argv[3:]),
                   cwd=cwd or os.getcwd(), env=dict(env), stdout=log_path,
                   stderr=stderr_path or log_path,
                   collect_at_exit=collect_at_exit)
    try:
      self._proc.stdin.write(json.dumps(request).encode() + b'\n')
      self._proc.stdin.flush()
    except OSError:
      return None
    reply = self._NextReply(60)
    if reply is None:  # A late reply would answer the next request.
      self._lost = True
    if not reply or 'pid' not in reply:
      return None
    return ForkedProcess(self, reply['pid'], argv)

  def ExitCode(self, pid: int) -> Optional[int]:
    with self._cv:
      return self._exits.get(pid)

  def WaitExit(self, pid: int, timeout_s: Optional[float]) -> Optional[int]:
    with self._cv:
      self._cv.wait_for(lambda: pid in self._exits, timeout_s)
      return self._exits.get(pid)

  def Close(self, timeout_s: float = 10) -> None:
    """Stops the server; it kills the tasks still running first."""
    if self._proc is None:
      return
    try:
      self._proc.stdin.close()
    except OSError:
      pass
    try:
      self._proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    if self._reader:
      self._reader.join(timeout_s)


# --- The server ----------------------------------------------------------------


_PROTOCOL_FD = 1  # The server's replies; fd 1 itself goes to its log.
_SERVER_PID = 0
_SITE_PATH = []


def _Write(msg: dict) -> None:
  os.write(_PROTOCOL_FD, json.dumps(msg).encode() + b'\n')


def _PrepareTitles() -> None:
  """Lets each task set its process title (its job and task in `ps`).

  setproctitle writes the title over the memory of argv and the environment
  it finds at its first use; a task replaces its environment (RunAsMain), so
  that first use is here, in the server.
  """
  try:
    import setproctitle  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  setproctitle.getproctitle()


def Serve(modules: Sequence[str]) -> Optional[dict]:
  """The server: imports for `modules`, then forks a task per request.

  Returns None in the server (its stdin closed: the launcher is done or
  gone), and a request in the task forked for it.
  """
  global _PROTOCOL_FD, _SERVER_PID
  # What an import prints goes to the log, not into the replies.
  _PROTOCOL_FD = os.dup(1)
  os.dup2(2, 1)
  _SITE_PATH[:] = SitePath()
  # What the imports make lives as long as the server and its tasks: frozen
  # (Fork), it is never collected; collecting while they run would only walk
  # it.
  gc.disable()
  Preload(modules)
  gc.freeze()
  gc.enable()
  _PrepareTitles()
  _Write({'ready': Threads()})
  _SERVER_PID = os.getpid()
  children = set()
  data = b''
  try:
    while True:
      ready, _, _ = select.select([0], [], [], 0.05)
      if ready:
        chunk = os.read(0, 1 << 20)
        if not chunk:
          return None
        data += chunk
        while b'\n' in data:
          line, data = data.split(b'\n', 1)
          request = json.loads(line)
          if Threads() != 1:
            _Write({'refused': f'{Threads()} threads'})
            continue
          started_r, started_w = os.pipe()
          pid = Fork()
          if not pid:
            os.close(started_r)
            _Detach(started_w)
            return request
          os.close(started_w)
          os.read(started_r, 1)  # Its own group now: the launcher may stop it.
          os.close(started_r)
          children.add(pid)
          _Write({'pid': pid})
      while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
          break
        children.discard(pid)
        _Write({'exited': pid, 'returncode': ReturnCode(status)})
  finally:
    if os.getpid() == _SERVER_PID:  # Not in a task.
      for pid in children:
        try:
          os.killpg(pid, signal.SIGKILL)
        except OSError:
          pass
      for pid in children:
        try:
          os.waitpid(pid, 0)
        except OSError:
          pass


def _Detach(started_fd: int) -> None:
  """In a new task: its own process group and session (for the launcher to
  stop it whole), SIGKILL with the server; then tells the server."""
  try:
    os.close(_PROTOCOL_FD)
    os.setsid()
    DieWithParent(_SERVER_PID)()
    os.write(started_fd, b'1')
    os.close(started_fd)
  except BaseException:  # pylint: disable=broad-except
    process.ExitNow(1)


def _RunTask(request: dict) -> None:
  """In the task forked for `request`: runs its module (see RunAsMain)."""
  Open = lambda path: os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                              0o644)
  out = Open(request['stdout'])
  err = out if request['stderr'] == request['stdout'] else Open(
      request['stderr'])
  RunAsMain(request['module'], request['argv'], request['cwd'],
            request['env'], out, err, _SITE_PATH,
            collect_at_exit=request['collect_at_exit'])


if __name__ == '__main__':
  _request = Serve(sys.argv[1:])
  if _request is not None:
    _RunTask(_request)
