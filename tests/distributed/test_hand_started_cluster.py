"""The hand-started cluster of docs/clusters.md: one trainer process per
task, started by the user, all on 127.0.0.1 (free ports).

At the end of training every task exits 0 (the controller tells the
workers), each task writes a log file of its own, and a hung worker is named
on the trainer client in one line, its traceback in the log file only.
Every process runs in its own group and is killed when the test ends.
"""

import contextlib
import os
import re
import signal
import sys

import pytest

from lingvo_ext.distributed import network
from tests.support import proc_testlib

TIMEOUT = 300
MODEL = 'lm.TransformerLmTinyGPipe'
TASKS = (('worker', 0), ('worker', 1), ('controller', 0),
         ('trainer_client', 0))


@contextlib.contextmanager
def _Cluster(logdir, *flags):
  """{'worker.0': Proc, ...}: each task's command, as docs/clusters.md's."""
  ports = network.FreePorts(4)
  spec = (f'controller=127.0.0.1:{ports[0]}@'
          f'trainer_client=127.0.0.1:{ports[1]}@'
          f'worker=127.0.0.1:{ports[2]},127.0.0.1:{ports[3]}')
  common = [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={MODEL}',
            f'--logdir={logdir}', '--mode=sync', f'--cluster_spec={spec}',
            '--worker_split_size=2', *flags]
  with contextlib.ExitStack() as stack:
    tasks = {}
    for job, task in TASKS:
      tasks[f'{job}.{task}'] = stack.enter_context(proc_testlib.Proc(
          [*common, f'--job={job}', f'--task={task}']))
    try:
      yield tasks
    finally:
      for t in tasks.values():  # A stopped task takes no SIGKILL's group.
        with contextlib.suppress(ProcessLookupError, OSError):
          t.proc.send_signal(signal.SIGCONT)


@pytest.mark.e2e
def testAtTheEndEveryTaskExits0AndEachHasItsOwnLog(tmp_path):
  logdir = str(tmp_path / 'log')
  # Far above the test's bound: a worker that waited for its clients to be
  # gone, rather than being told the end, would not exit in time.
  with _Cluster(logdir, '--max_steps=4', '--cluster_wait_secs=3600') as tasks:
    codes = {name: t.Wait(TIMEOUT) for name, t in tasks.items()}
  out = {name: t.Text() for name, t in tasks.items()}
  assert codes == {name: 0 for name in tasks}, out
  for name in ('worker.0', 'worker.1'):
    job, task = name.split('.')
    assert f'{job} task {task}: controller finished training; exiting.' in (
        out[name]), out[name][-3000:]
  logs = sorted(f for f in os.listdir(logdir) if f.startswith('log.'))
  assert logs == ['log.controller.0.txt', 'log.trainer_client.0.txt',
                  'log.worker.0.txt', 'log.worker.1.txt'], logs


@pytest.mark.e2e
def testAHungWorkerIsOneLineOnTheTrainerClientAndItsTracebackIsInTheLog(
    tmp_path):
  logdir = str(tmp_path / 'log')
  with _Cluster(logdir, '--max_steps=1000000',
                '--worker_timeout_secs=10') as tasks:
    client = tasks['trainer_client.0']
    client.WaitFor(r'^step \d+/', TIMEOUT)
    tasks['worker.1'].proc.send_signal(signal.SIGSTOP)
    rc = client.Wait(TIMEOUT)
  out = client.Text()
  assert rc == 1, out[-3000:]
  lost = [l for l in out.splitlines() if 'lost contact' in l]
  assert len(lost) == 1, out[-3000:]
  assert re.match(r'trainer_client: lost contact with worker task 1 '
                  r'\(/job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+\) '
                  r'\(DeadlineExceededError\); exiting', lost[0]), lost
  # Nothing but the tool's own lines: no traceback, no absl record echoed.
  assert 'Traceback' not in out, out[-3000:]
  assert not re.search(r'^[EF]\d{4} ', out, re.M), out[-3000:]
  with open(os.path.join(logdir, 'log.trainer_client.0.txt')) as f:
    log = f.read()
  assert 'Traceback' in log and 'DeadlineExceededError' in log
