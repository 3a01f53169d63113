"""The plan check under lingvo_ext.launch, end to end (no time asserted).

The task that trains (the trainer client) and each worker (they hold the
cells) print the `plan check:` line once, prefixed with the task's name as
their other lines. A cold calibration holds the steps only once the
prediction's process reaches it, so the run is long enough to outlast the
profiling before it.
"""

import re
import sys

import pytest

from tests.support import proc_testlib

MODEL = 'lm.TransformerLmTinyGPipe'
LINE = (r'plan check: step \d+\.\d ms, predicted \d+\.\d ms '
        r'\((?:[+-]\d+|0)%\); peak memory \d+ MB, predicted \d+ MB '
        r'\((?:[+-]\d+|0)%\)$')


@pytest.mark.e2e
def testTheClientAndEachWorkerPrintTheLineOnce(tmp_path):
  with proc_testlib.Proc([
      sys.executable, '-m', 'lingvo_ext.launch', f'--model={MODEL}',
      f'--logdir={tmp_path}', '--workers=2', '--worker_split_size=2',
      '--max_steps=1500', '--plan_check_steps=10',
      '--plan_check_secs=0']) as run:
    assert run.Wait(1800) == 0, run.Text()[-5000:]
  out = run.Text()
  for task in ('trainer_client', 'worker0', 'worker1'):
    got = re.findall(rf'^\[{task}\] {LINE}', out, re.M)
    assert len(got) == 1, (task, out[-5000:])
