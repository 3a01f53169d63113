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

Why forking there is safe: see lingvo_ext/distributed/fork_server.py, whose
pieces this uses (lingvo_ext.launch forks its tasks the same way); a run
whose import-time environment differs from the server's gets a fresh
interpreter (e.g. TF_ENABLE_ONEDNN_OPTS, which TensorFlow reads once). A
forked run ends as an interpreter does, but for the garbage collection at
exit (RunAsMain's collect_at_exit=False: objects left in reference cycles
are not finalized), which would cost a Transformer run about a CPU-second.
Tests that signal a trainer by pid or need a fresh interpreter call
subprocess themselves.
"""

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

from lingvo_ext.distributed import fork_server

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Modules run from the server; the server imports what they import.
MODULES = ('lingvo_ext.trainer', 'lingvo_ext.tools.cost_report',
           'lingvo_ext.tools.list_models',
           'lingvo_ext.tools.convert_checkpoint', 'lingvo_ext.tools.plan',
           'lingvo_ext.examples.gpipe_example', 'lingvo_ext.launch',
           'bench.transformer')
# Off with LINGVO_EXT_TEST_ZYGOTE=0 (every run a fresh interpreter).
ENABLED = os.environ.get('LINGVO_EXT_TEST_ZYGOTE', '1') != '0'
forks = 0  # Runs forked from the server in this process (tests/test_zygote.py).


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
    self.env = dict(os.environ, **fork_server.SERVER_ENV)
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
  server_env = _CLIENT.env or os.environ
  return fork_server.ImportEnv(server_env) == fork_server.ImportEnv(env)


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


def _Serve(sock_path):
  """Forks a child per request; sends its pid, then its exit code.

  Returns None in the server (the pytest process is gone), and
  (request, site_path) in a child.
  """
  site_path = fork_server.SitePath()
  fork_server.Preload(MODULES)
  server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  server.bind(sock_path)
  server.listen(16)
  sys.stdout.write('ready\n')
  sys.stdout.flush()
  children = {}  # pid: connection
  pid = os.getpid()
  try:
    while True:
      ready, _, _ = select.select([server, sys.stdin], [], [], 0.05)
      if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
        return None  # The pytest process is gone.
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
        if fork_server.Threads() != 1:
          conn.sendall(b'{"refused": "threads"}\n')
          conn.close()
          continue
        child = fork_server.Fork()
        if not child:
          for c in [server, conn, *children.values()]:
            c.close()
          return request, site_path
        children[child] = conn
        conn.sendall(json.dumps({'pid': child}).encode() + b'\n')
      while children:
        child, status = os.waitpid(-1, os.WNOHANG)
        if not child:
          break
        conn = children.pop(child, None)
        if conn:
          code = fork_server.ReturnCode(status)
          try:
            conn.sendall(json.dumps({'returncode': code}).encode() + b'\n')
          except OSError:
            pass
          conn.close()
  finally:
    if os.getpid() == pid:  # Not in a child.
      for child in children:
        try:
          os.killpg(child, signal.SIGKILL)
          os.waitpid(child, 0)
        except OSError:
          pass


def _RunChild(request, site_path):
  """In a forked child: the run, in its own process group (a timeout or a
  test kills it all); the interpreter's exit ends it (RunAsMain)."""
  os.setsid()
  out = os.open(request['stdout'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  err = out if request['stderr'] == request['stdout'] else os.open(
      request['stderr'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  fork_server.RunAsMain(request['module'], request['argv'], request['cwd'],
                        request['env'], out, err, site_path,
                        collect_at_exit=False)


if __name__ == '__main__':
  _child = _Serve(sys.argv[1])
  if _child:
    _RunChild(*_child)
