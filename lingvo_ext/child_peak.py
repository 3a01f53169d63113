"""A child process's own peak RSS, as the child reads it at its exit.

Linux's ru_maxrss of a child (os.wait4) is the larger of the child's own
peak and that of the address space it replaced at exec, which after fork or
vfork is its parent's: a child of a planner holding 6 GB reads 6 GB whatever
it used. `Run` starts `python -m lingvo_ext.child_peak FILE MODULE ARGS...`,
which runs MODULE as `__main__` and writes its VmHWM (which exec resets) to
FILE at exit.
"""

import atexit
import os
import runpy
import subprocess
import sys
import tempfile
import time
from typing import Optional
from typing import Sequence
from typing import Tuple


def StatusBytes(field: str = 'VmHWM', pid='self') -> Optional[int]:
  """A /proc/PID/status size in bytes (VmHWM: the peak resident set, VmRSS:
  the current one); None if the process or the field is gone."""
  try:
    with open(f'/proc/{pid}/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def Run(module: str, args: Sequence[str], env=None, stdout=None,
        stderr=None, timeout_s: Optional[float] = None
        ) -> Tuple[int, Optional[int]]:
  """Runs `python -m module args` in a fresh process.

  Returns:
    (its exit code, its peak RSS in bytes, None where it ended without
    Python's exit handlers: a signal, os._exit).

  Raises:
    TimeoutError: it ran past `timeout_s` (then it was killed).
  """
  fd, path = tempfile.mkstemp(prefix='lingvo_ext_peak_')
  os.close(fd)
  try:
    proc = subprocess.Popen(
        [sys.executable, '-m', 'lingvo_ext.child_peak', path, module,
         *args], env=env, stdout=stdout, stderr=stderr)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while proc.poll() is None:
      if deadline is not None and time.monotonic() > deadline:
        proc.kill()
        proc.wait()
        raise TimeoutError(f'{module} did not finish in {timeout_s:.0f} s')
      time.sleep(0.2)
    with open(path) as f:
      text = f.read().strip()
    return proc.returncode, int(text) if text else None
  finally:
    os.remove(path)


def _Main(argv):
  # The program's quiet console and caches, set up as the program itself
  # would (it imports entry_point first too).
  from lingvo_ext import entry_point  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  path, module = argv[1], argv[2]

  def Write():
    with open(path, 'w') as f:
      f.write(str(StatusBytes('VmHWM') or ''))

  atexit.register(Write)
  sys.argv = [module] + argv[3:]
  runpy.run_module(module, run_name='__main__', alter_sys=True)


if __name__ == '__main__':
  _Main(sys.argv)
