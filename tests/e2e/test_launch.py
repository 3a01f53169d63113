"""lingvo_ext.launch: clusters configured only by TF_CONFIG or SLURM_*,
readable output, logs in files, and no task outliving the launcher.

Each launcher runs in its own process group
(tests/support/proc_testlib.py), killed when its `with` block ends; every
wait is bounded. Tasks have groups of their own: the tests kill those too.
"""

import glob
import os
import re
import signal
import sys
import time

import pytest

from lingvo_ext.distributed import cluster
from tests.support import proc_testlib

MODEL = 'lm.TransformerLmTinyGPipe'
# A log record of Lingvo (absl) or TensorFlow's C++ runtime.
_RECORD = re.compile(r'^\[\w+\] ([IWEF]\d{4} |WARNING: All log messages)')


class _Launch(proc_testlib.Proc):
  """`python -m lingvo_ext.launch ...`; reads its output unless told not to."""

  def __init__(self, logdir, *flags, read=True):
    super().__init__([sys.executable, '-m', 'lingvo_ext.launch',
                      f'--model={MODEL}', f'--logdir={logdir}', *flags],
                     read=read)


def _PortFree(address):
  try:
    cluster.CheckPortFree(address, 'a task')
    return True
  except ValueError:
    return False


def _Log(logdir, name):
  with open(os.path.join(logdir, 'launch', name)) as f:
    return f.read()


@pytest.mark.e2e
def testTFConfigOnlyClusterTrainsToMaxSteps(tmp_path):
  """A chief, 2 workers (1 replica x 2 cells) and a ps, told only TF_CONFIG."""
  logdir = str(tmp_path / 'tf_config')
  with _Launch(logdir, '--cluster_from=tf_config', '--workers=2', '--ps=1',
               '--worker_split_size=2', '--max_steps=5') as run:
    assert run.Wait(300) == 0, run.Text()[-5000:]
  out = run.Text()
  # Readable output: state changes and the progress line, no log records.
  records = [l for l in run.lines if _RECORD.match(l)]
  assert not records, records[:5]
  for task in ('chief task 0', 'worker task 0', 'worker task 1', 'ps task 0'):
    assert re.search(rf'^launch: started {task} \(127\.0\.0\.1:\d+\) as pid '
                     rf'\d+; log: ', out, re.M), task
    assert re.search(rf'^launch: {task} \(\S+\) is ready$', out, re.M), task
  assert re.search(r'^\[chief\] step 5/5  loss \d', out, re.M), out
  assert re.search(r'^launch: chief task 0 \(\S+\) finished$', out, re.M)
  assert out.rstrip().endswith('launch: stopped all 4 processes.')
  # Each task's whole log is in LOGDIR/launch/JOB.TASK.log; its command had
  # no --cluster_spec, --job or --task: only TF_CONFIG.
  # (replan.log is the elastic launcher's plan ahead for one worker fewer,
  # docs/faults.md, not a task's.)
  names = sorted(os.path.basename(p) for p in glob.glob(
      os.path.join(logdir, 'launch', '*.log')))
  assert [n for n in names if n != 'replan.log'] == [
      'chief.0.log', 'ps.0.log', 'worker.0.log', 'worker.1.log']
  roles = {'chief.0.log': 'controller,trainer_client task 0',
           'worker.0.log': 'worker task 0', 'worker.1.log': 'worker task 1',
           'ps.0.log': 'ps task 0'}
  for name, role in roles.items():
    log = _Log(logdir, name)
    header = log.splitlines()[0]
    assert 'TF_CONFIG=' in header and '--cluster_resolver=tf_config' in header
    assert not re.search(r'--(cluster_spec|job|task)=', header), header
    assert f'TF_CONFIG: this process is {role} of the cluster ' in log, name
  assert 'Cluster layout: ' in _Log(logdir, 'chief.0.log')  # The full log.
  # The ps task held the variables; the chief saved step 5 and told the
  # servers, which exited 0.
  assert "cluster.ps.name : '/job:ps'" in _Log(logdir, 'chief.0.log')
  assert os.path.exists(os.path.join(logdir, 'train',
                                     'ckpt-00000005.index'))
  for name in ('worker.0.log', 'worker.1.log', 'ps.0.log'):
    assert 'controller,trainer_client finished training; exiting.' in _Log(
        logdir, name), name


@pytest.mark.e2e
def testSlurmEnvironmentRunIsNotSlowedByASlowReader(tmp_path):
  """2 nodes (127.0.0.1, .2) x 2 worker tasks + the chief, told only SLURM_*.

  --stream_logs into a pipe that nobody reads until training has saved its
  last checkpoint: the tasks write to files, so training does not wait.
  """
  logdir = str(tmp_path / 'slurm')
  with _Launch(logdir, '--cluster_from=slurm', '--nodes=2', '--workers=4',
               '--worker_split_size=2', '--max_steps=5', '--stream_logs',
               read=False) as run:
    last = os.path.join(logdir, 'train', 'ckpt-00000005.index')
    deadline = time.monotonic() + 300
    while not os.path.exists(last):
      assert time.monotonic() < deadline, 'no checkpoint of step 5'
      assert run.proc.poll() is None, run.proc.stdout.read()[-5000:]
      time.sleep(0.5)
    run.StartReading()
    assert run.Wait(120) == 0, run.Text()[-5000:]
  out = run.Text()
  assert len(out) > 1 << 16  # More than a pipe holds: a reader that waits
  # would have blocked every task had they written to the launcher's pipe.
  # --stream_logs: every line of every task, log records included.
  assert any(_RECORD.match(l) for l in run.lines)
  assert re.search(r'^\[chief\] step 5/5 ', out, re.M)
  chief = _Log(logdir, 'chief.0.log')
  m = re.search(r'Slurm: this process is controller,trainer_client task 0 of '
                r'the cluster (\S+)', chief)
  assert m, chief[-3000:]
  jobs = cluster.ParseClusterSpec(m.group(1))
  hosts = [cluster.Host(a) for a in jobs['controller'] + jobs['worker']]
  assert hosts == ['127.0.0.1'] * 3 + ['127.0.0.2'] * 2, jobs
  ports = [cluster.Port(a) for a in jobs['controller'] + jobs['worker']]
  assert ports == list(range(ports[0], ports[0] + 5)), ports
  for i in range(4):
    log = _Log(logdir, f'worker.{i}.log')
    assert 'SLURM_PROCID=%d ' % (i + 1) in log.splitlines()[0]
    assert f'Slurm: this process is worker task {i} of the cluster ' in log


# Forked tasks (the default) die with their fork server, which dies with
# the launcher; fresh interpreters die with the launcher.
@pytest.mark.e2e
@pytest.mark.parametrize('fork_tasks', ['true', 'false'])
def testKilledLauncherLeavesNoTaskAndFreesItsPorts(tmp_path, fork_tasks):
  """kill -9 of the launcher mid-run: within 10 s every task is gone."""
  logdir = str(tmp_path / 'kill')
  # --network=host: the ports are this host's, to check that they are free.
  with _Launch(logdir, '--network=host', '--workers=2',
               '--worker_split_size=2', '--max_steps=100000',
               f'--fork_tasks={fork_tasks}') as run:
    m = run.WaitFor(r'launch: all 4 tasks are serving: (\S+)', 240)
    addresses = sum(cluster.ParseClusterSpec(m.group(1)).values(), [])
    run.WaitFor(r'^\[trainer_client\] step \d+/100000 ', 240)  # Mid-run.
    pids = run.Pids()
    assert len(pids) == 4 and all(proc_testlib.Alive(p) for p in pids.values()), pids
    server = re.search(r'launch: forking the tasks from pid (\d+)', run.Text())
    assert bool(server) == (fork_tasks == 'true'), run.Text()
    if server:
      pids['fork server'] = int(server.group(1))
    assert all(proc_testlib.Alive(p) for p in pids.values()), pids
    assert not any(_PortFree(a) for a in addresses), addresses
    os.kill(run.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < 30:
      alive = [w for w, p in pids.items() if proc_testlib.Alive(p)]
      taken = [a for a in addresses if not _PortFree(a)]
      if not alive and not taken:
        break
      time.sleep(0.2)
    assert not alive and not taken, (alive, taken)
