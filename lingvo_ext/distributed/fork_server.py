"""Trainer tasks forked from one process that has imported TensorFlow once.

A `python -m lingvo_ext.trainer` task spends about 4 CPU-seconds importing
TensorFlow and Lingvo before it does anything else, and a local cluster
starts several at once (and again on every restart). `lingvo_ext.launch`
instead starts one server process (`python -m
lingvo_ext.distributed.fork_serving MODULE...`) that imports what the MODULEs
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

This module is the launcher's side (`ForkServer`, `ForkedProcess`);
fork_serving.py is the server's. The protocol, one JSON object per line:
the server writes {"ready": ...} after its imports; to each request on its
stdin ({"module", "argv", "cwd", "env", "stdout", "stderr",
"collect_at_exit"}; stdout and stderr are paths the task appends to, the
same path for one log) it answers {"pid": N} or {"refused": WHY}, and writes
{"exited": N, "returncode": RC} when task N ends (RC < 0: killed by signal
-RC, as subprocess reports it).
"""

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Dict
from typing import Mapping
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo_ext.distributed import fork_serving

# Environment variables a library may read at import (TF_CONFIG excepted).
IMPORT_ENV = ('TF_', 'OMP_', 'KMP_', 'MKL_', 'CUDA', 'XLA_', 'PYTHON', 'LD_',
              'OPENBLAS_', 'GOTO', 'NPY_', 'JAX_', 'ABSL_')
_READ_AT_RUN_TIME = ('TF_CONFIG',)
# Set in the server only: OpenBLAS then starts no thread.
SERVER_ENV = {'OPENBLAS_NUM_THREADS': '1'}

# Kept where callers found them (the server's side moved out).
DieWithParent = fork_serving.DieWithParent
Fork = fork_serving.Fork
Preload = fork_serving.Preload
ReturnCode = fork_serving.ReturnCode
RunAsMain = fork_serving.RunAsMain
Serve = fork_serving.Serve
SitePath = fork_serving.SitePath
Threads = fork_serving.Threads


def ImportEnv(env: Mapping[str, str]) -> Dict[str, str]:
  """The variables of `env` that a library may read at import.

  Not PYTHONPATH (fork_serving.RunAsMain puts it on sys.path) nor
  SERVER_ENV's.
  """
  return {k: v for k, v in env.items()
          if k.startswith(IMPORT_ENV) and k not in _READ_AT_RUN_TIME and
          k not in SERVER_ENV and k != 'PYTHONPATH'}


class ForkedProcess:
  """A task forked by the server: the part of subprocess.Popen we use."""

  def __init__(self, server: 'ForkServer', pid: int, args: Sequence[str],
               key: Tuple[int, int]):
    self._server = server
    self.pid = pid
    self._key = key  # (pid, serial): a later task may reuse the pid.
    self.args = list(args)
    self.returncode = None

  def poll(self) -> Optional[int]:  # pylint: disable=invalid-name
    if self.returncode is None:
      self.returncode = self._server.ExitCode(self._key)
    return self.returncode

  def wait(self, timeout: Optional[float] = None) -> int:  # pylint: disable=invalid-name
    if self.returncode is None:
      rc = self._server.WaitExit(self._key, timeout)
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
    # A long run forks thousands of tasks, and the kernel reuses pids: a
    # task is known by (pid, serial), serial counting the forks.
    self._exits = {}  # (pid, serial): return code.
    self._alive = {}  # pid: serial of the task not reported yet.
    self._serial = 0
    self._lost = False  # The server's output ended, or it stopped answering.
    self._reader = None

  def Start(self, timeout_s: float) -> Optional[str]:
    """Starts the server; None once it has imported, else why it cannot."""
    self._env = dict(os.environ, **self._extra_env, **SERVER_ENV)
    with open(self._log_path, 'ab') as log:
      self._proc = subprocess.Popen(
          [sys.executable, '-m', fork_serving.__name__, *self.modules],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
          env=self._env, preexec_fn=fork_serving.DieWithParent(os.getpid()),
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
          pid = msg['exited']
          if pid in self._alive:
            self._exits[pid, self._alive.pop(pid)] = msg['returncode']
        else:
          if 'pid' in msg:  # Before its exit can be reported.
            self._serial += 1
            msg['serial'] = self._alive[msg['pid']] = self._serial
          self._replies.append(msg)
        self._cv.notify_all()
    with self._cv:
      # Its tasks die with it (PR_SET_PDEATHSIG).
      for pid, serial in self._alive.items():
        self._exits.setdefault((pid, serial), -int(signal.SIGKILL))
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
      collect_at_exit: See fork_serving.RunAsMain.
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
    return ForkedProcess(self, reply['pid'], argv,
                         (reply['pid'], reply['serial']))

  def ExitCode(self, key: Tuple[int, int]) -> Optional[int]:
    """The exit code of task `key` ((pid, serial)), None while it runs."""
    with self._cv:
      return self._exits.get(key)

  def WaitExit(self, key: Tuple[int, int],
               timeout_s: Optional[float]) -> Optional[int]:
    with self._cv:
      self._cv.wait_for(lambda: key in self._exits, timeout_s)
      return self._exits.get(key)

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
