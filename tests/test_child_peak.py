"""child_peak: a child's own peak RSS, not its parent's."""

import os
import subprocess
import sys

from lingvo_ext import child_peak

_MB = 2**20


def testAChildOfALargeParentReadsItsOwnPeakNotTheParents():
  big = bytearray(600 * _MB)
  big[::4096] = b'\1' * len(big[::4096])  # Resident.
  # What wait4 says of a plain child: the parent's pages.
  proc = subprocess.Popen([sys.executable, '-c', 'pass'])
  _, _, usage = os.wait4(proc.pid, 0)
  assert usage.ru_maxrss * 1024 > 600 * _MB
  code, peak = child_peak.Run('platform', [], stdout=subprocess.DEVNULL)
  assert code == 0
  assert 1 * _MB < peak < 200 * _MB, peak / _MB
  del big


def testTheChildsExitCodeAndArgvPassThrough(tmp_path):
  mod = tmp_path / 'exits3.py'
  mod.write_text('import sys\nx = bytearray(80 << 20)\nx[::4096] = '
                 'b"\\1" * len(x[::4096])\nsys.exit(len(sys.argv))\n')
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  code, peak = child_peak.Run('exits3', ['a', 'b'], env=env)
  assert code == 3
  assert peak > 80 * _MB


def testAChildThatSkipsExitHandlersHasNoPeak(tmp_path):
  (tmp_path / 'hard.py').write_text('import os\nos._exit(0)\n')
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  assert child_peak.Run('hard', [], env=env) == (0, None)
