"""The fork server's own process: imports once, then forks a task per request.

`python -m lingvo_ext.distributed.fork_serving MODULE...` is started by
fork_server.ForkServer, which says why forking here is safe and what the
protocol is. The server imports what the MODULEs import (`Preload`), then
answers each request on its stdin by forking a task (`Serve`) that runs its
MODULE as __main__ as `python -m` would (`RunAsMain`).
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
import sys
from typing import List
from typing import Mapping
from typing import Optional
from typing import Sequence

from lingvo_ext import entry_point  # pylint: disable=unused-import
from lingvo_ext._internal import process

_PR_SET_PDEATHSIG = 1


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
  import numpy  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  import tensorflow  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
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


def ReturnCode(status: int) -> int:
  """A waitpid status as subprocess reports it (-N: killed by signal N)."""
  if os.WIFSIGNALED(status):
    return -os.WTERMSIG(status)
  return os.WEXITSTATUS(status)


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
