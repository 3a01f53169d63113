"""What the launcher asks of its tasks: do they answer, how big, OOM-killed?

Light (no TensorFlow): the launcher imports it.

- `Answers`: a task's TensorFlow server answers an HTTP/2 connection
  preface with its SETTINGS frame (gRPC speaks HTTP/2). A stopped process
  (SIGSTOP, swapping to death) or a network that drops packets still lets
  the kernel accept the TCP connection, but sends nothing back: a plain
  connect cannot tell it from a live one.
- `RssBytes`: a process's resident memory (/proc/PID/status).
- `OomKills`: the count of the kernel's OOM kills in a process's cgroup
  (cgroup v2 memory.events, v1 memory.oom_control), so a SIGKILL is known
  to be the OOM killer's and not anyone's.
"""

import os
import socket
from typing import Optional
from typing import Tuple

from lingvo_ext import child_peak

_PREFACE = (b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n'
            # An empty SETTINGS frame: length 0, type 4, flags 0, stream 0.
            b'\x00\x00\x00\x04\x00\x00\x00\x00\x00')


def Answers(host: str, port: int, timeout_s: float) -> bool:
  """Whether the gRPC server at host:port sends a frame within timeout_s."""
  try:
    with socket.create_connection((host, port), timeout=timeout_s) as s:
      s.settimeout(timeout_s)
      s.sendall(_PREFACE)
      return bool(s.recv(9))
  except OSError:
    return False


def State(pid: int) -> Optional[str]:
  """The process's state letter (R, S, T stopped, Z...), or None if gone."""
  try:
    with open(f'/proc/{pid}/stat', 'rb') as f:
      data = f.read().decode('ascii', 'replace')
    return data.rsplit(')', 1)[1].split()[0]
  except (OSError, IndexError):
    return None


def RssBytes(pid: int) -> Optional[int]:
  """The process's resident set size, or None if it is gone."""
  return child_peak.StatusBytes('VmRSS', pid)


def CgroupDir(pid: int) -> Optional[str]:
  """The memory cgroup's directory of `pid` (v2, else v1), or None."""
  try:
    with open(f'/proc/{pid}/cgroup') as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in lines:
    _, controllers, path = line.split(':', 2)
    if controllers == '':  # cgroup v2's unified hierarchy.
      d = os.path.join('/sys/fs/cgroup', path.lstrip('/'))
      if os.path.exists(os.path.join(d, 'memory.events')):
        return d
    elif 'memory' in controllers.split(','):
      d = os.path.join('/sys/fs/cgroup/memory', path.lstrip('/'))
      if os.path.exists(os.path.join(d, 'memory.oom_control')):
        return d
  return None


def OomKills(cgroup_dir: Optional[str]) -> Optional[int]:
  """The OOM kills counted in `cgroup_dir` so far, or None if unknown."""
  if not cgroup_dir:
    return None
  for name in ('memory.events', 'memory.oom_control'):
    try:
      with open(os.path.join(cgroup_dir, name)) as f:
        for line in f:
          key, _, value = line.partition(' ')
          if key == 'oom_kill':
            return int(value)
    except (OSError, ValueError):
      continue
  return None


def MemoryLimit(cgroup_dir: Optional[str]) -> Optional[int]:
  """The cgroup's memory limit in bytes, or None (none, or unknown)."""
  if not cgroup_dir:
    return None
  for name in ('memory.max', 'memory.limit_in_bytes'):
    try:
      with open(os.path.join(cgroup_dir, name)) as f:
        text = f.read().strip()
    except OSError:
      continue
    if text == 'max':
      return None
    try:
      value = int(text)
    except ValueError:
      return None
    return value if value < (1 << 60) else None
  return None


def FormatBytes(n: Optional[float]) -> str:
  if n is None:
    return 'unknown'
  for unit in ('B', 'KB', 'MB', 'GB'):
    if n < 1024 or unit == 'GB':
      return f'{n:.0f} {unit}' if unit in ('B', 'KB') else f'{n:.1f} {unit}'
    n /= 1024
  return f'{n:.1f} TB'


def AvailableBytes() -> Tuple[Optional[int], str]:
  """(bytes this process may use, where that figure comes from): its
  cgroup's memory limit, else MemAvailable, whichever is less."""
  limit = MemoryLimit(CgroupDir(os.getpid()))
  available = None
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          available = int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  if limit is not None and (available is None or limit < available):
    return limit, "the cgroup's memory limit"
  return available, "this machine's available memory"
