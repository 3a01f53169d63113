"""A worker lost for good under lingvo_ext.launch: the pipeline re-planned
onto the worker left, resumed from the newest checkpoint, trained to
--max_steps (distributed/elastic.py, launching.py, tools/replan.py).

The launcher runs in a process group of its own (tests/support/
proc_testlib.py); every wait is bounded and what it started is killed.
"""

import os
import re
import signal
import sys
import time

import lingvo.compat as tf
import pytest

from lingvo_ext.checkpoints import files
from tests.support import proc_testlib

TIMEOUT = 300
MAX_STEPS = 300
_STARTED_1 = re.compile(r'launch: started worker task 1 \(\S+\) as pid (\d+)')
_STARTED = re.compile(r'launch: started \w+ task \d+ \(\S+\) as pid (\d+)')


def _Steps(text):
  return [int(s) for s in re.findall(r'^\[trainer_client\] step (\d+)/', text,
                                     re.M)]


@pytest.mark.e2e
def testAWorkerKilledAtEveryRestartLeavesAJobThatFinishesOnTheOtherOne(
    tmp_path):
  logdir = str(tmp_path / 'log')
  argv = [sys.executable, '-m', 'lingvo_ext.launch',
          '--model=lm.TransformerLmTinyGPipe', f'--logdir={logdir}',
          '--workers=2', '--worker_split_size=2', f'--max_steps={MAX_STEPS}',
          '--max_restarts=1', '--ready_timeout_secs=120',
          '--model_params_override=train.save_interval_seconds:1']
  killed = set()
  with proc_testlib.Proc(argv) as run:
    run.WaitFor(r'^\[trainer_client\] step \d+/', TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    # Kill worker task 1 at its start and at every restart.
    while 'is lost for good' not in run.Text():
      assert time.monotonic() < deadline, run.Text()[-5000:]
      assert run.proc.poll() is None, run.Text()[-5000:]
      for pid in map(int, _STARTED_1.findall(run.Text())):
        if pid not in killed:
          os.kill(pid, signal.SIGKILL)
          killed.add(pid)
      time.sleep(0.1)
    rc = run.Wait(TIMEOUT)
  out = run.Text()
  assert rc == 0, out[-5000:]
  assert len(killed) == 2, (killed, out[-5000:])
  lost = re.findall(r'^launch: worker task 1 is lost for good \(signal '
                    r'SIGKILL after 1 restart\(s\) in all, --max_restarts=1\): '
                    r're-planned onto 1 worker \((\d+) cells? on 1 device, M '
                    r'(\d+)\); resuming from (ckpt-(\d+))\.$', out, re.M)
  assert len(lost) == 1, out[-5000:]
  _, _, ckpt, resumed = lost[0]
  recovered = re.findall(r'^launch: recovered: step (\d+) trained ([\d.]+) s '
                         r'after the loss, on 1 worker\.$', out, re.M)
  assert len(recovered) == 1, out[-5000:]
  # The step counter goes on from the checkpoint resumed, to --max_steps.
  after = out[out.index('is lost for good'):]
  steps = _Steps(after)
  assert steps and steps[0] > int(resumed) and steps[-1] == MAX_STEPS, after
  assert int(recovered[0][0]) == steps[0]
  assert re.search(r'^launch: 1 replica\(s\) x 1 cell\(s\)', after, re.M)
  assert 'launch: training finished' in after
  assert out.rstrip().endswith('launch: stopped all 3 processes.'), out[-3000:]
  # No orphans: every task of both clusters is gone.
  for pid in map(int, _STARTED.findall(out)):
    assert not proc_testlib.Alive(pid), pid
  # Every checkpoint is whole, the one resumed from still there, and the
  # names of the 2-cell cut are the 1-device plan's: the restore across the
  # cuts renamed nothing.
  train = os.path.join(logdir, 'train')
  paths = files.CheckpointPaths(train)
  assert paths, os.listdir(train)
  for path in paths:
    assert files.CheckpointProblem(path) is None, path
  old = os.path.join(train, ckpt)
  assert tf.io.gfile.exists(old + '.index'), os.listdir(train)
  final = os.path.join(train, f'ckpt-{MAX_STEPS:08d}')
  keys = tf.train.load_checkpoint(final).get_variable_to_shape_map()
  assert tf.train.load_checkpoint(old).get_variable_to_shape_map() == keys
  with open(os.path.join(logdir, 'launch', 'controller.0.log')) as f:
    log = f.read()
  assert 'across a different cut' not in log
