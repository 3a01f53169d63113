"""The trainer's `plan check:` line, end to end (no time asserted).

The steadiness thresholds come down by flag (--plan_check_steps,
--plan_check_secs): a run long enough prints the line exactly once, on the
console, in the log and as TensorBoard scalars; a shorter run prints none.
"""

import glob
import os
import re
import subprocess
import sys

import lingvo.compat as tf
import pytest

from tests.support import ROOT
from tests.support import zygote

TIMEOUT = 900
MODEL = 'lm.TransformerLmTiny'
LONG = 3000  # Steps of a run that outlasts its prediction.
LINE = re.compile(r'^plan check: step \d+\.\d ms, predicted \d+\.\d ms '
                  r'\((?:[+-]\d+|0)%\); peak memory \d+ MB, predicted \d+ MB '
                  r'\((?:[+-]\d+|0)%\)$', re.M)
OFF = re.compile(r'^plan check: the (step|peak memory) is predicted \d+% '
                 r'(low|high); its largest term is .+; recalibrate with: '
                 r'\.venv/bin/python -m lingvo_ext\.'
                 rf'(tools\.plan --model={MODEL} --devices=2 --recalibrate|'
                 r'tools\.memory_probe --num_devices=2 --force)\.$', re.M)


def _Train(logdir, *flags):
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={MODEL}',
       f'--logdir={logdir}', '--num_cpu_devices=2', '--worker_split_size=2',
       *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, timeout=TIMEOUT, check=False)
  assert proc.returncode == 0, proc.stdout[-5000:]
  return proc.stdout


def _Scalars(event_dir):
  out = {}
  for path in glob.glob(os.path.join(event_dir, 'events.out.*')):
    for event in tf.train.summary_iterator(path):
      for v in event.summary.value:
        if v.tag.startswith('plan_check/'):
          out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


@pytest.mark.e2e
def testALongEnoughRunPrintsTheLineOnce(tmp_path):
  # Training does not wait for the prediction (seconds of profiling with a
  # warm cache): enough steps to outlast it.
  out = _Train(tmp_path, f'--max_steps={LONG}', '--plan_check_steps=10',
               '--plan_check_secs=0')
  lines = [l for l in out.splitlines() if l.startswith('plan check:')]
  assert len(LINE.findall(out)) == 1, out[-3000:]
  # The second line only where a figure is off by more than 25%.
  assert len(lines) == 1 + len(OFF.findall(out)), lines
  assert all(LINE.match(l) or OFF.match(l) for l in lines), lines
  with open(os.path.join(tmp_path, 'log.controller+trainer_client.txt')) as f:
    log = f.read()
  assert log.count(lines[0]) == 1
  scalars = _Scalars(os.path.join(tmp_path, 'train'))
  assert sorted(scalars) == sorted(
      'plan_check/' + t for t in ('step_ms', 'predicted_step_ms',
                                  'step_error', 'peak_memory_mb',
                                  'predicted_peak_memory_mb',
                                  'peak_memory_error'))
  # Printed at one step, the figures as the line rounds them.
  [(step, mb)] = scalars['plan_check/peak_memory_mb']
  assert 11 <= step <= LONG
  assert f'peak memory {mb:.0f} MB' in lines[0]


@pytest.mark.e2e
def testAShortRunPrintsNoLine(tmp_path):
  out = _Train(tmp_path, '--max_steps=6', '--plan_check_steps=10',
               '--plan_check_secs=0')
  assert 'plan check' not in out, out[-3000:]
  assert not _Scalars(os.path.join(tmp_path, 'train'))
