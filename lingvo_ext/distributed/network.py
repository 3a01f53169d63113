"""The launcher's network: a private namespace, free ports on 127.0.0.1.

TensorFlow's gRPC server listens on every interface of its host (it binds
the wildcard address; TensorFlow has no option for a bind address) and does
no authentication. So by default (--network=private) the launcher first
moves itself into a new network namespace that has only a loopback
interface (`EnterPrivateNetwork`): its tasks talk over 127.0.0.1 and nothing
outside can connect to them. `FreePorts` and `FreePortRange` pick the
tasks' ports.
"""

import ctypes
import fcntl
import os
import random
import socket
import struct
from typing import List

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
