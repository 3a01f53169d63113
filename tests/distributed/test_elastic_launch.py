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
from lingvo_ext.distributed import cluster_tasks
from lingvo_ext.distributed import elastic as elastic_lib
from lingvo_ext.distributed import launch_lib
from lingvo_ext.distributed import launching
from lingvo_ext.distributed import network
from tests.support import launcher_testlib
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


# --- The Launcher's side, with tasks that are plain python programs ----------


def _Launcher(tmp_path, programs, max_restarts, elastic, ready_timeout_s=30):
  out = launcher_testlib.Lines()
  ports = network.FreePorts(len(programs))
  tasks = [cluster_tasks.Task(job, t, f'127.0.0.1:{port}',
                              [sys.executable, '-c', code])
           for (job, t, code), port in zip(programs, ports)]
  launcher = launch_lib.Launcher(tasks, str(tmp_path), ready_timeout_s,
                                 max_restarts, out, fork_tasks=False,
                                 task_timeout_s=60, elastic=elastic)
  return launcher, out.lines


_SLEEPS = 'import time; time.sleep(120)'
_FAILS = 'import sys; sys.exit(3)'


@pytest.mark.e2e
@pytest.mark.parametrize('elastic', [True, False])
def testAWorkerFailingPastMaxRestartsIsLostForGood(tmp_path, elastic):
  launcher, lines = _Launcher(tmp_path, [('worker', 0, _SLEEPS),
                                         ('worker', 1, _FAILS),
                                         ('controller', 0, _SLEEPS)],
                              max_restarts=1, elastic=elastic)
  rc = launcher_testlib.Run(launcher)
  assert launcher.restarts == 1
  text = '\n'.join(lines)
  if elastic:
    assert rc == launch_lib.EXIT_LOST
    assert launcher.lost == elastic_lib.Loss(
        'worker', 1, 'exit code 3 after 1 restart(s) in all, '
        '--max_restarts=1')
    assert 'giving up' not in text
  else:
    assert rc == 1 and launcher.lost is None
    assert 'already restarted 1 task(s) (--max_restarts=1): giving up' in (
        text)
  assert all(t.proc.poll() is not None for t in launcher.tasks)


@pytest.mark.e2e
def testARestartedWorkerNotServingWithinTheBoundIsLost(tmp_path):
  # Serves its port at the first start only; its restart never does.
  marker = tmp_path / 'started'
  code = (f'import os, socket, sys, time\n'
          f'if not os.path.exists({str(marker)!r}):\n'
          f'  open({str(marker)!r}, "w").close()\n'
          f'  s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1])))\n'
          f'  s.listen(); time.sleep(1); sys.exit(1)\n'
          f'time.sleep(120)\n')
  launcher, lines = _Launcher(tmp_path, [('worker', 0, _SLEEPS),
                                         ('worker', 1, code),
                                         ('controller', 0, _SLEEPS)],
                              max_restarts=3, elastic=True,
                              ready_timeout_s=3)
  launcher.tasks[1].argv.append(launcher.tasks[1].address.split(':')[1])
  assert launcher_testlib.Run(launcher) == launch_lib.EXIT_LOST, lines
  assert launcher.lost.what == 'worker task 1'
  assert re.match(r'not back \d+ s after its restart, '
                  r'--ready_timeout_secs=3$', launcher.lost.why), launcher.lost
  assert all(t.proc.poll() is not None for t in launcher.tasks)


def testTheNewestCheckpointIsTheStateFilesOne(tmp_path):
  assert launching.NewestCheckpoint(str(tmp_path)) is None
  (tmp_path / 'train').mkdir()
  (tmp_path / 'train' / 'checkpoint').write_text(
      'model_checkpoint_path: "/x/train/ckpt-00000700"\n'
      'all_model_checkpoint_paths: "ckpt-00000600"\n')
  assert launching.NewestCheckpoint(str(tmp_path)) == 'ckpt-00000700'
