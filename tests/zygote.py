"""`python -m lingvo_ext.<tool>` runs for tests, forked from a pre-imported server.

MODULES lists what it serves: the trainer, the launcher, the tools, and
bench/transformer.py's per-variant children (as `-m bench.transformer`).

Importing TensorFlow and Lingvo costs ~5 of a small trainer run's ~13
CPU-seconds; the end-to-end tests start dozens of such runs. run() is
subprocess.run for a command `[sys.executable, '-m', module, ...]`: where it
can, it forks the run from a server process (one per pytest worker) that has
imported TensorFlow, Lingvo and the modules lingvo_ext.trainer imports, and
runs `module` as __main__ there with the test's argv, cwd, environment and
sys.path, stdin /dev/null, stdout/stderr captured, in its own process group
(a timeout kills the group). Otherwise (another program, another oneDNN
setting, ...) it is subprocess.run itself.

Why forking there is safe:
* TensorFlow starts no thread at import (no op has run in the server; the
  eager context and its thread pools are made by the child). The only threads
  an import starts are OpenBLAS's (numpy, scipy); the server runs with
  OPENBLAS_NUM_THREADS=1 (the child's environment is the test's own) and
  checks, before each fork, that it is a single-threaded process, else it
  refuses and run() falls back to a fresh interpreter.
* Environment variables read at import (TF_*, OMP_*, KMP_*, MKL_*, CUDA*,
  XLA_*, PYTHON* other than PYTHONPATH, LD_*, OPENBLAS_*) must equal the
  server's, else run() uses a fresh interpreter (e.g. TF_ENABLE_ONEDNN_OPTS,
  which TensorFlow reads once, when it loads).
* `module` itself is not imported in the server (its imports are), so it runs
  fresh as __main__ like under `python -m`; Python's `random` reseeds itself
  after a fork and the child reseeds numpy's global generator.
* The child ends like an interpreter: non-daemon threads joined, atexit
  handlers run, streams flushed, exit code as SystemExit gives it, 1 after an
  uncaught exception (traceback on stderr).
Tests that signal a trainer by pid or need a fresh interpreter call
subprocess themselves.
"""

import ast
import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Modules run from the server; the server imports what they import.
MODULES = ('lingvo_ext.trainer', 'lingvo_ext.tools.cost_report',
           'lingvo_ext.tools.list_models',
           'lingvo_ext.tools.convert_checkpoint', 'lingvo_ext.tools.plan',
           'lingvo_ext.examples.gpipe_example', 'lingvo_ext.launch',
           'bench.transformer')
# Environment variables a library may read at import: a run whose value
# differs from the server's gets a fresh interpreter.
_IMPORT_ENV = ('TF_', 'OMP_', 'KMP_', 'MKL_', 'CUDA', 'XLA_', 'PYTHON', 'LD_',
               'OPENBLAS_', 'GOTO', 'NPY_', 'JAX_', 'ABSL_')
_SERVER_ENV = {'OPENBLAS_NUM_THREADS': '1'}
# Off with LINGVO_EXT_TEST_ZYGOTE=0 (every run a fresh interpreter).
ENABLED = os.environ.get('LINGVO_EXT_TEST_ZYGOTE', '1') != '0'
forks = 0  # Runs forked from the server in this process (tests/test_zygote.py).


def _ImportEnv(env):
  return {k: v for k, v in env.items()
          if k.startswith(_IMPORT_ENV) and k != 'PYTHONPATH'}


# --- Client (in the pytest process) -------------------------------------------


class _Client:
  """One server per pytest process, started on first use."""

  def __init__(self):
    self._lock = threading.Lock()
    self._proc = None
    self._path = None
    self.env = None

  def _Start(self):
    self._path = tempfile.mkdtemp(prefix='zygote-')
    sock = os.path.join(self._path, 'sock')
    self.env = dict(os.environ, **_SERVER_ENV)
    self.env['PYTHONPATH'] = _ROOT
    # stdin: the server exits when this process closes it (or dies).
    self._proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), sock], cwd=_ROOT,
        env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL)
    ready = self._proc.stdout.readline()  # After its imports.
    if ready.strip() != b'ready':
      self._proc.kill()
      self._proc.wait()
      raise RuntimeError('zygote server did not start: %r' % ready)
    atexit.register(self.Stop)
    self.sock = sock

  def Stop(self):
    if self._proc and self._proc.poll() is None:
      self._proc.stdin.close()
      try:
        self._proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()
    if self._path:
      shutil.rmtree(self._path, ignore_errors=True)

  def Connect(self):
    with self._lock:
      if self._proc is None:
        self._Start()
      if self._proc.poll() is not None:
        raise RuntimeError('zygote server exited')
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(self.sock)
    return conn


_CLIENT = _Client()


def _Usable(cmd, env):
  if not ENABLED or len(cmd) < 3 or cmd[0] != sys.executable:
    return False
  if cmd[1] != '-m' or cmd[2] not in MODULES:
    return False
  server_env = _CLIENT.env or dict(os.environ, **_SERVER_ENV)
  mine = _ImportEnv(server_env)
  for k in _SERVER_ENV:  # The child gets the test's own value.
    mine.pop(k, None)
  theirs = _ImportEnv(env)
  for k in _SERVER_ENV:
    theirs.pop(k, None)
  return mine == theirs


class _Lines:
  """The server's one-line JSON replies on a connection."""

  def __init__(self, conn):
    self._conn, self._data = conn, b''

  def Next(self, timeout):
    """The next reply ({} at EOF); socket.timeout after `timeout` seconds."""
    self._conn.settimeout(timeout)
    while b'\n' not in self._data:
      chunk = self._conn.recv(4096)
      if not chunk:
        return {}
      self._data += chunk
    line, self._data = self._data.split(b'\n', 1)
    return json.loads(line)


def run(cmd, cwd=None, env=None, stdout=None, stderr=None,
        capture_output=False, text=False, timeout=None, check=False):
  """subprocess.run(cmd, ...), forked from the server where it can be.

  Only the arguments listed; stdout PIPE (else a fresh interpreter); stderr
  PIPE, STDOUT or None (copied to this process's stderr after the run).
  """
  env = dict(os.environ if env is None else env)
  if capture_output:
    stdout = stderr = subprocess.PIPE
  if (not _Usable(cmd, env) or stdout != subprocess.PIPE or
      stderr not in (subprocess.PIPE, subprocess.STDOUT, None)):
    return subprocess.run(cmd, cwd=cwd, env=env, stdout=stdout,
                          stderr=stderr, text=text, timeout=timeout,
                          check=check)
  with tempfile.TemporaryDirectory(prefix='zygote-run-') as tmp:
    out_path = os.path.join(tmp, 'out')
    err_path = out_path if stderr == subprocess.STDOUT else os.path.join(
        tmp, 'err')
    request = dict(module=cmd[2], argv=list(cmd[3:]),
                   cwd=os.path.abspath(cwd or os.getcwd()), env=env,
                   stdout=out_path, stderr=err_path)
    conn = _CLIENT.Connect()
    with conn:
      conn.sendall(json.dumps(request).encode() + b'\n')
      replies = _Lines(conn)
      reply = replies.Next(60)
      if 'pid' not in reply:  # Refused (e.g. not single-threaded).
        return subprocess.run(cmd, cwd=cwd, env=env, stdout=stdout,
                              stderr=stderr, text=text, timeout=timeout,
                              check=check)
      pid = reply['pid']
      global forks
      forks += 1
      try:
        done = replies.Next(timeout)
        timed_out = False
      except socket.timeout:
        timed_out = True
        try:
          os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        done = replies.Next(60)
    if 'returncode' not in done:
      raise RuntimeError('zygote server lost run %d' % pid)

    def Read(path):
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
    proc = subprocess.CompletedProcess(cmd, done['returncode'], out, err)
    if check:
      proc.check_returncode()
    return proc


# --- Server --------------------------------------------------------------------


def _Preload():
  """Imports TF, Lingvo and what each of MODULES imports (not MODULES)."""
  import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
  import numpy  # pylint: disable=g-import-not-at-top,unused-import
  import importlib  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  for module in MODULES:
    path = importlib.util.find_spec(module).origin
    with open(path) as f:
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


def _Threads():
  return len(os.listdir('/proc/self/task'))


def _Child(request, base_path):
  """In the forked child: runs the module as __main__; never returns."""
  code = 1
  try:
    os.setsid()  # Its own process group: a timeout or a test kills it all.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    out = os.open(request['stdout'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    if request['stderr'] == request['stdout']:
      os.dup2(out, 2)
    else:
      os.dup2(os.open(request['stderr'], os.O_WRONLY | os.O_CREAT |
                      os.O_TRUNC), 2)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    pythonpath = [p for p in request['env'].get('PYTHONPATH', '').split(
        os.pathsep) if p]
    # As under `python -m`: the cwd, then PYTHONPATH, then the site paths.
    sys.path[:] = [request['cwd']] + pythonpath + base_path
    import numpy  # pylint: disable=g-import-not-at-top
    numpy.random.seed()
    import runpy  # pylint: disable=g-import-not-at-top
    sys.argv = ['-m'] + request['argv']
    try:
      runpy.run_module(request['module'], run_name='__main__', alter_sys=True)
      code = 0
    except SystemExit as e:
      if e.code is None:
        code = 0
      elif isinstance(e.code, int):
        code = e.code
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      code = 1
    threading._shutdown()  # pylint: disable=protected-access
    atexit._run_exitfuncs()  # pylint: disable=protected-access
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        pass
    os._exit(code)  # pylint: disable=protected-access


def _Serve(sock_path):
  """Forks a child per request; sends its pid, then its exit code."""
  # sys.path as under `python script`: this file's folder, PYTHONPATH, site.
  n = 1 + len([p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep)
               if p])
  base_path = sys.path[n:]
  _Preload()
  server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  server.bind(sock_path)
  server.listen(16)
  sys.stdout.write('ready\n')
  sys.stdout.flush()
  children = {}  # pid: connection
  try:
    while True:
      ready, _, _ = select.select([server, sys.stdin], [], [], 0.2)
      if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
        return  # The pytest process is gone.
      if server in ready:
        conn, _ = server.accept()
        conn.settimeout(60)
        data = b''
        while not data.endswith(b'\n'):
          chunk = conn.recv(1 << 20)
          if not chunk:
            break
          data += chunk
        request = json.loads(data)
        if _Threads() != 1:
          conn.sendall(b'{"refused": "threads"}\n')
          conn.close()
          continue
        pid = os.fork()
        if pid == 0:
          for c in [server, conn, *children.values()]:
            c.close()
          _Child(request, base_path)
        children[pid] = conn
        conn.sendall(json.dumps({'pid': pid}).encode() + b'\n')
      while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
          break
        conn = children.pop(pid, None)
        if conn:
          code = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                  else os.WEXITSTATUS(status))
          try:
            conn.sendall(json.dumps({'returncode': code}).encode() + b'\n')
          except OSError:
            pass
          conn.close()
  finally:
    for pid in children:
      try:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
      except OSError:
        pass


if __name__ == '__main__':
  _Serve(sys.argv[1])
