"""The hand-started cluster of docs/clusters.md: one trainer process per
task, started by the user, all on 127.0.0.1 (free ports).

At the end of training every task exits 0 (the controller tells the
workers), each task writes a log file of its own, and a hung or killed
worker is named on each client in one line within --worker_timeout_secs and
a few seconds, its traceback in the log file only. On
two hosts of their own (network namespaces joined by a veth pair, made by
the test) the cluster trains to the one-process numbers. Every process runs
in its own group and is killed when the test ends.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import lingvo.compat as tf
import numpy as np
import pytest

from lingvo_ext.distributed import network
from tests.support import events_testlib
from tests.support import proc_testlib

TIMEOUT = 300
MODEL = 'lm.TransformerLmTinyGPipe'
TASKS = (('worker', 0), ('worker', 1), ('controller', 0),
         ('trainer_client', 0))


@contextlib.contextmanager
def _Cluster(logdir, *flags, hosts=None):
  """{'worker.0': Proc, ...}: each task's command, as docs/clusters.md's.

  hosts: {task name: (network namespace, address)}; default: all on
  127.0.0.1 of this network, on free ports.
  """
  if hosts is None:
    ports = iter(network.FreePorts(len(TASKS)))
    where = {f'{j}.{t}': ([], f'127.0.0.1:{next(ports)}') for j, t in TASKS}
  else:
    where = {name: (['ip', 'netns', 'exec', ns], f'{address}:{2222 + i}')
             for i, (name, (ns, address)) in enumerate(hosts.items())}
  spec = '@'.join(
      f'{job}=' + ','.join(where[f'{j}.{t}'][1] for j, t in TASKS if j == job)
      for job in ('controller', 'trainer_client', 'worker'))
  common = ['-m', 'lingvo_ext.trainer', f'--model={MODEL}',
            f'--logdir={logdir}', '--mode=sync', f'--cluster_spec={spec}',
            '--worker_split_size=2', *flags]
  with contextlib.ExitStack() as stack:
    tasks = {}
    for job, task in TASKS:
      prefix = where[f'{job}.{task}'][0]
      tasks[f'{job}.{task}'] = stack.enter_context(proc_testlib.Proc(
          [*prefix, sys.executable, *common, f'--job={job}',
           f'--task={task}']))
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


_NOISE = re.compile(r'^([EFW]\d{4} |ERROR:|WARNING:tensorflow|Traceback)', re.M)
_LOST = (r'^{job}: lost contact with worker task 1 '
         r'\(/job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+\) '
         r'\((DeadlineExceededError|UnavailableError)\); (exiting|retrying)')


@pytest.mark.e2e
@pytest.mark.parametrize('how', ['SIGSTOP', 'SIGKILL'])
def testAHungOrLostWorkerIsNamedOnEachClientInOneLineWithinTheBound(
    tmp_path, how):
  """Each client names the worker within --worker_timeout_secs and a few
  seconds, in one line (and a last one if it then exits); the tracebacks
  and TensorFlow's error records are in its log file only."""
  logdir = str(tmp_path / 'log')
  bound = 10
  with _Cluster(logdir, '--max_steps=1000000',
                f'--worker_timeout_secs={bound}') as tasks:
    client = tasks['trainer_client.0']
    client.WaitFor(r'^step \d+/', TIMEOUT)
    t0 = time.monotonic()
    tasks['worker.1'].proc.send_signal(getattr(signal, how))
    for name in ('trainer_client.0', 'controller.0'):
      tasks[name].WaitFor(_LOST.format(job=name.split('.')[0]), bound + 30)
      # Named within the bound and the probes' own timeouts.
      assert time.monotonic() - t0 < bound + 30, name
    rc = client.Wait(TIMEOUT)
    # What the controller prints meanwhile (it waits --cluster_wait_secs
    # for the trainer client before it exits).
    time.sleep(5)
    out = {name: tasks[name].Text() for name in ('trainer_client.0',
                                                   'controller.0')}
  assert rc == 1, out['trainer_client.0'][-3000:]
  for name, text in out.items():
    job = name.split('.')[0]
    lost = [l for l in text.splitlines() if 'lost contact' in l]
    # The lost task's line; a retried step's end names it once more.
    assert 1 <= len(lost) <= 2, text[-3000:]
    for line in lost:
      assert re.match(_LOST.format(job=job), line), line
    assert lost[-1].endswith('re-run its command).') or (
        job == 'controller'), lost
    # Nothing but the tool's own lines: no traceback, no record echoed.
    assert not _NOISE.search(text), text[-3000:]
  with open(os.path.join(logdir, 'log.trainer_client.0.txt')) as f:
    log = f.read()
  assert 'Traceback' in log
  assert re.search(r'DeadlineExceededError|UnavailableError', log)


def _Ip(*args):
  return subprocess.run(['ip', *args], capture_output=True, text=True,
                        timeout=30)


@pytest.fixture
def two_hosts():
  """Two network namespaces joined by a veth pair: {name: address}.

  198.18.0.0/15 is the range set aside for benchmarking networks (RFC
  2544): the hosts' addresses exist only inside these namespaces. A 2 ms
  netem delay each way where the kernel has netem.
  """
  tag = f'lx{os.getpid() % 100000}'
  hosts = {f'{tag}a': '198.18.0.1', f'{tag}b': '198.18.0.2'}
  made = []
  try:
    for ns in hosts:
      r = _Ip('netns', 'add', ns)
      if r.returncode:
        pytest.skip(f'cannot make network namespaces here: {r.stderr.strip()}')
      made.append(ns)
    (a, b) = hosts
    steps = [('link', 'add', f'{a}v', 'type', 'veth', 'peer', 'name', f'{b}v')]
    for ns, address in hosts.items():
      steps += [('link', 'set', f'{ns}v', 'netns', ns),
                ('-n', ns, 'addr', 'add', f'{address}/24', 'dev', f'{ns}v'),
                ('-n', ns, 'link', 'set', 'lo', 'up'),
                ('-n', ns, 'link', 'set', f'{ns}v', 'up')]
    for step in steps:
      r = _Ip(*step)
      if r.returncode:
        pytest.skip(f'cannot join namespaces by veth here: ip {" ".join(step)}:'
                    f' {r.stderr.strip()}')
    for ns in hosts:  # Optional: where netem is missing, no delay.
      subprocess.run(['ip', 'netns', 'exec', ns, 'tc', 'qdisc', 'add', 'dev',
                      f'{ns}v', 'root', 'netem', 'delay', '2ms'],
                     capture_output=True, timeout=30, check=False)
    yield hosts
  finally:
    for ns in made:
      _Ip('netns', 'del', ns)  # Its end of the veth pair goes with it.


@pytest.mark.e2e
def testAClusterAcrossNetworkNamespacesTrainsAsOneProcess(tmp_path, two_hosts):
  (a, b), (addr_a, addr_b) = list(two_hosts), list(two_hosts.values())
  # head (a): the clients and cell 0; node (b): cell 1, over the veth pair.
  hosts = {'worker.0': (a, addr_a), 'worker.1': (b, addr_b),
           'controller.0': (a, addr_a), 'trainer_client.0': (a, addr_a)}
  logdir = str(tmp_path / 'cluster')
  with _Cluster(logdir, '--max_steps=3', hosts=hosts) as tasks:
    codes = {name: t.Wait(TIMEOUT) for name, t in tasks.items()}
  assert codes == {name: 0 for name in tasks}, {
      n: t.Text()[-2000:] for n, t in tasks.items()}
  single = str(tmp_path / 'single')
  proc = subprocess.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={MODEL}',
       f'--logdir={single}', '--num_cpu_devices=2', '--worker_split_size=2',
       '--max_steps=3'], cwd=proc_testlib.ROOT, capture_output=True,
      text=True, timeout=TIMEOUT, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  loss = events_testlib.Scalars(os.path.join(logdir, 'train'), 'loss')
  ref = events_testlib.Scalars(os.path.join(single, 'train'), 'loss')
  assert loss and sorted(loss) == sorted(ref), (loss, ref)
  np.testing.assert_allclose([loss[s] for s in sorted(loss)],
                             [ref[s] for s in sorted(ref)], atol=1e-5)
  got = tf.train.load_checkpoint(os.path.join(logdir, 'train', 'ckpt-00000003'))
  want = tf.train.load_checkpoint(os.path.join(single, 'train',
                                               'ckpt-00000003'))
  names = sorted(want.get_variable_to_shape_map())
  assert sorted(got.get_variable_to_shape_map()) == names
  for name in names:
    np.testing.assert_allclose(got.get_tensor(name), want.get_tensor(name),
                               atol=1e-5, err_msg=name)
