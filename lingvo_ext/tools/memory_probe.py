"""Measures this machine's constants of the peak-RSS memory model, again.

  .venv/bin/python -m lingvo_ext.tools.memory_probe --num_devices=2 --force

The probe and its cache: lingvo_ext/planner/memory_probe.py; what the
constants are: docs/faults.md, "Memory".
"""

import sys

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-bad-import-order
from lingvo_ext.planner import memory_probe

if __name__ == '__main__':
  sys.exit(memory_probe.main(sys.argv[1:]))
