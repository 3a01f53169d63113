"""`python -m MODULE ARGS...` forked by a test's zygote server.

tests/support/zygote.py's Bridge shim runs `python -S -E zygote_client.py
SOCKET -m MODULE ARGS...`: this asks the test process listening on SOCKET
to fork the run with this process's environment, working folder, stdout and
stderr, and exits with its exit code; where it cannot (refused, no server,
an output that is not a pipe, file or terminal), it becomes a fresh
interpreter running the command. Only the standard library: it starts in
milliseconds.
"""

import json
import os
import socket
import stat
import sys


def _Reopenable(fd):
  """Whether the fork server can open /proc/PID/fd/FD as this fd's file."""
  try:
    mode = os.fstat(fd).st_mode
  except OSError:
    return False
  return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISCHR(mode)


def Main():
  path, argv = sys.argv[1], sys.argv[2:]
  reply = {}
  if _Reopenable(1) and _Reopenable(2):
    pid = os.getpid()
    request = dict(argv=argv, env=dict(os.environ), cwd=os.getcwd(),
                   stdout=f'/proc/{pid}/fd/1', stderr=f'/proc/{pid}/fd/2')
    try:
      with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        sock.sendall(json.dumps(request).encode() + b'\n')
        reply = json.loads(sock.makefile().readline() or '{}')
    except (OSError, ValueError):
      reply = {}
  if 'returncode' not in reply:
    os.execv(sys.executable, [sys.executable, *argv])
  returncode = reply['returncode']
  sys.exit(returncode if returncode >= 0 else 128 - returncode)


if __name__ == '__main__':
  Main()
