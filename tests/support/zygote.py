"""`python -m lingvo_ext.<tool>` runs for tests, forked from a pre-imported server.

MODULES lists what it serves: the trainer, the launcher, the tools,
bench/transformer.py's per-variant children (as `-m bench.transformer`),
bench/pipeline.py (as `-m bench.pipeline`) and `python -c CODE` (as `-m
tests.support.zygote_code CODE`, which runs CODE as `-c` does).

Importing TensorFlow and Lingvo costs ~5 of a small trainer run's ~13
CPU-seconds; the end-to-end tests start dozens of such runs. run() is
subprocess.run for a command `[sys.executable, '-m', module, ...]` (or `-c
CODE`): where it can, it forks the run from a server process (one per
pytest worker) that has imported TensorFlow, Lingvo and the modules
lingvo_ext.trainer imports, and runs `module` as __main__ there with the
test's argv, cwd, environment and sys.path, stdin /dev/null, stdout/stderr
captured, in its own process group (a timeout kills the group). Otherwise (another program, another oneDNN
setting, ...) it is subprocess.run itself.

The server is lingvo_ext/distributed/fork_server.py's, which says why
forking there is safe (lingvo_ext.launch forks its tasks from one too); a run
whose import-time environment differs from the server's gets a fresh
interpreter (e.g. TF_ENABLE_ONEDNN_OPTS, which TensorFlow reads once). A
forked run ends as an interpreter does, but for the garbage collection at
exit (RunAsMain's collect_at_exit=False: objects left in reference cycles
are not finalized), which would cost a Transformer run about a CPU-second.
Runs a test signals by pid go through Fork (tests/support/proc_testlib.py's Proc
and Start); tests that need a fresh interpreter call subprocess
themselves.
"""

import atexit
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from lingvo_ext.distributed import fork_server
from tests.support import ROOT as _ROOT

# Modules run from the server; the server imports what they import.
MODULES = ('lingvo_ext.trainer', 'lingvo_ext.tools.cost_report',
           'lingvo_ext.tools.list_models',
           'lingvo_ext.tools.convert_checkpoint', 'lingvo_ext.tools.plan',
           'lingvo_ext.examples.gpipe_example', 'lingvo_ext.launch',
           'bench.transformer', 'bench.pipeline', 'tests.support.zygote_code')
# Off with LINGVO_EXT_TEST_ZYGOTE=0 (every run a fresh interpreter).
ENABLED = os.environ.get('LINGVO_EXT_TEST_ZYGOTE', '1') != '0'
# Runs forked from the server in this process (tests/support/test_zygote.py).
forks = 0

# One server per pytest process, started on first use; its output is not
# kept (a run's is).
_SERVER = fork_server.ForkServer(MODULES, os.devnull,
                                 extra_env=dict(PYTHONPATH=_ROOT))
_LOCK = threading.Lock()
_started = []


def _Served(cmd):
  """cmd, a `-c CODE` run as `-m tests.support.zygote_code CODE`."""
  if list(cmd[:2]) == [sys.executable, '-c'] and len(cmd) > 2:
    return [sys.executable, '-m', 'tests.support.zygote_code', *cmd[2:]]
  return list(cmd)


def _Usable(cmd, env):
  return ENABLED and _SERVER.Usable(_Served(cmd), env)


def _Start():
  """Starts the server if need be; call it from the main thread, whose exit
  the server must not outlive (fork_server.ForkServer)."""
  with _LOCK:
    if not _started:
      why = _SERVER.Start(300)
      if why:
        raise RuntimeError('zygote server did not start: ' + why)
      atexit.register(_SERVER.Close)
      _started.append(True)


def Usable(cmd, env):
  """Whether Fork can fork `cmd` with `env` (if the server allows)."""
  return _Usable(cmd, env)


def Fork(cmd, env, cwd, out_path, err_path):
  """`cmd` forked from the server (started first if need be), its stdout and
  stderr appended to the files at out_path and err_path, in a process group
  of its own; a Popen-like handle (pid, poll, wait), or None if refused.
  Call it from the main thread."""
  global forks
  proc = _Fork(cmd, env, cwd, out_path, err_path)
  if proc is not None:
    forks += 1
  return proc


def _Fork(cmd, env, cwd, out_path, err_path):
  """The run forked from the server (started first if need be), or None."""
  _Start()
  with _LOCK:
    return _SERVER.Spawn(_Served(cmd), env, out_path, stderr_path=err_path,
                         cwd=os.path.abspath(cwd or os.getcwd()),
                         collect_at_exit=False)


def run(cmd, cwd=None, env=None, stdout=None, stderr=None,
        capture_output=False, text=False, timeout=None, check=False):
  """subprocess.run(cmd, ...), forked from the server where it can be.

  Only the arguments listed; stdout PIPE (else a fresh interpreter); stderr
  PIPE, STDOUT or None (copied to this process's stderr after the run).
  """
  global forks
  env = dict(os.environ if env is None else env)
  if capture_output:
    stdout = stderr = subprocess.PIPE
  Fresh = lambda: subprocess.run(cmd, cwd=cwd, env=env, stdout=stdout,
                                 stderr=stderr, text=text, timeout=timeout,
                                 check=check)
  if (not _Usable(cmd, env) or stdout != subprocess.PIPE or
      stderr not in (subprocess.PIPE, subprocess.STDOUT, None)):
    return Fresh()
  with tempfile.TemporaryDirectory(prefix='zygote-run-') as tmp:
    out_path = os.path.join(tmp, 'out')
    err_path = out_path if stderr == subprocess.STDOUT else os.path.join(
        tmp, 'err')
    proc = _Fork(cmd, env, cwd, out_path, err_path)
    if proc is None:  # Refused (e.g. not single-threaded).
      return Fresh()
    forks += 1
    try:
      returncode = proc.wait(timeout)
      timed_out = False
    except subprocess.TimeoutExpired:
      timed_out = True
      try:
        os.killpg(proc.pid, signal.SIGKILL)  # Its process group, whole.
      except ProcessLookupError:
        pass
      returncode = proc.wait(60)

    def Read(path):
      if not os.path.exists(path):  # Nothing written.
        return '' if text else b''
      with open(path, 'rb') as f:
        data = f.read()
      return data.decode() if text else data

    out = Read(out_path)
    err = None if stderr == subprocess.STDOUT else Read(err_path)
  if stderr is None:
    sys.stderr.write(err if text else err.decode(errors='replace'))
    err = None
  if timed_out:
    raise subprocess.TimeoutExpired(cmd, timeout, out, err)
  proc = subprocess.CompletedProcess(cmd, returncode, out, err)
  if check:
    proc.check_returncode()
  return proc


# --- Runs that another program starts (a docs example's bash) -----------------

_CLIENT = os.path.join(_ROOT, 'tests', 'support', 'zygote_client.py')
_SHIM = '''#!/bin/sh
# %(python)s, but `-m MODULE` of tests/support/zygote.py's MODULES and
# `-c CODE` are forked from a test's zygote server
# (tests/support/zygote_client.py).
case "$1 $2" in
  %(cases)s) exec %(python)s -S -E %(client)s %(socket)s "$@" ;;
esac
if [ "$1" = -c ] && [ $# -ge 2 ]; then
  exec %(python)s -S -E %(client)s %(socket)s "$@"
fi
exec %(python)s "$@"
'''


class Bridge:
  """Forks the `python -m MODULE` runs of a program the test starts.

  Write Shim() where the program looks for the venv's python (a docs
  example's `.venv/bin/python`): its `-m MODULE` runs (MODULE one of
  MODULES) and `-c CODE` runs connect to this process, which forks them
  from its server as run() does, their output going to the shim's own
  stdout and stderr; the others (and runs the server refuses) are a fresh
  interpreter. A run
  whose shim dies (the program killed) is killed. Create it in the main
  thread: the server it may start must not die with another thread.
  """

  def __init__(self, directory):
    _Start()
    self._path = os.path.join(directory, 'zygote.sock')
    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    self._sock.bind(self._path)
    self._sock.listen(8)
    threading.Thread(target=self._Accept, daemon=True,
                     name='zygote_bridge').start()

  def Shim(self):
    """The text of the shim (a shell script) to write as the venv's python."""
    return _SHIM % dict(
        python=shlex.quote(sys.executable), client=shlex.quote(_CLIENT),
        socket=shlex.quote(self._path),
        cases='|'.join(shlex.quote('-m ' + m) for m in MODULES))

  def Close(self):
    self._sock.close()

  def _Accept(self):
    while True:
      try:
        conn, _ = self._sock.accept()
      except OSError:  # Closed.
        return
      threading.Thread(target=self._Handle, args=(conn,), daemon=True).start()

  def _Handle(self, conn):
    global forks
    with conn:
      request = json.loads(conn.makefile().readline() or 'null')
      if not request:
        return
      cmd = [sys.executable, *request['argv']]
      env, proc = request['env'], None
      if _Usable(cmd, env):
        proc = _Fork(cmd, env, request['cwd'], request['stdout'],
                     request['stderr'])
      if proc is None:  # The client runs a fresh interpreter.
        conn.sendall(b'{}\n')
        return
      forks += 1
      while True:
        try:
          returncode = proc.wait(0.5)
          break
        except subprocess.TimeoutExpired:
          if select.select([conn], [], [], 0)[0] and not conn.recv(1):
            try:  # The client is gone: so is its run, whole.
              os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
              pass
            proc.wait(60)
            return
      conn.sendall(json.dumps(dict(returncode=returncode)).encode() + b'\n')
