"""Training across processes: lingvo_ext.launch, placement, numbers, failures.

Every cluster runs through `python -m lingvo_ext.launch`, which puts its
processes in a private network namespace with only 127.0.0.1, on free
ports. Each test starts the launcher in its own process group and kills the
group in `finally`; every wait is bounded.
"""

import collections
import fcntl
import glob
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time

import lingvo.compat as tf
import numpy as np
import pytest

from lingvo_ext.distributed import cluster
from tests.support import ROOT
from tests.support import proc_testlib
from tests.support import zygote

MODEL = 'lm.TransformerLmTinyGPipe'


class _Launch(proc_testlib.Proc):
  """`python -m lingvo_ext.launch ...` in its own process group."""

  def __init__(self, logdir, *flags):
    super().__init__([sys.executable, '-m', 'lingvo_ext.launch',
                      f'--model={MODEL}', f'--logdir={logdir}', *flags])

  def Tail(self, n=60):
    keep = [l for l in self.lines if 'base_runner.py:113' not in l]
    return ''.join(keep[-n:])

  def Kill(self):
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(30)
      except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in self.Pids().values():  # Tasks have their own groups.
      try:
        os.killpg(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait(10)


def _Scalars(event_dir, tag):
  values = {}
  for path in sorted(glob.glob(os.path.join(event_dir, 'events.out.*'))):
    try:
      for event in tf.train.summary_iterator(path):
        for v in event.summary.value:
          if v.tag == tag:
            values.setdefault(event.step, []).append(v.simple_value)
    except tf.errors.DataLossError:
      pass  # The last record of a writer killed with kill -9.
  return values


def _Checkpoint(logdir, step):
  return tf.train.load_checkpoint(
      os.path.join(logdir, 'train', 'ckpt-%08d' % step))


def _NonLoopbackIPv4():
  """The IPv4 addresses of this host's interfaces other than loopback."""
  out = []
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for _, name in socket.if_nameindex():
      if name == 'lo':
        continue
      try:
        ifr = fcntl.ioctl(s, 0x8915, struct.pack('256s', name.encode()[:15]))
        out.append(socket.inet_ntoa(ifr[20:24]))  # SIOCGIFADDR
      except OSError:
        pass
  return out


def _ListeningSockets(pid):
  """[(local address hex, port)] of the TCP listeners in pid's namespace."""
  out = []
  for name in ('tcp', 'tcp6'):
    with open(f'/proc/{pid}/net/{name}') as f:
      for line in f.readlines()[1:]:
        local, _, state = line.split()[1:4]
        if state == '0A':  # LISTEN
          addr, port = local.split(':')
          out.append((addr, int(port, 16)))
  return out


def _Refused(host, port):
  try:
    with socket.create_connection((host, port), timeout=2):
      return False
  except OSError:
    return True


@pytest.fixture(scope='module')
def single_process(shared_once):
  """The logdir of MODEL trained 3 steps in one process on 4 CPU devices.

  2 replicas x 2 cells with Lingvo's shared variables: the numbers of one
  large batch, which every gradient_sync must reproduce. Built once for all
  test workers (conftest.py).
  """
  return shared_once('single_process', _TrainSingleProcess)


def _TrainSingleProcess(single):
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={MODEL}',
       f'--logdir={single}', '--num_cpu_devices=4', '--worker_split_size=2',
       '--max_steps=3'], cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:]
  return single


def _AssertSameNumbers(logdir, single):
  """Loss at step 1 and every checkpointed value at step 3 agree to 1e-5."""
  loss = _Scalars(os.path.join(logdir, 'train'), 'loss')
  ref = _Scalars(os.path.join(single, 'train'), 'loss')
  np.testing.assert_allclose(loss[1], ref[1], atol=1e-5)
  got, want = _Checkpoint(logdir, 3), _Checkpoint(single, 3)
  names = sorted(want.get_variable_to_shape_map())
  assert sorted(got.get_variable_to_shape_map()) == names
  for name in names:
    np.testing.assert_allclose(
        got.get_tensor(name), want.get_tensor(name), atol=1e-5, err_msg=name)


@pytest.mark.e2e
def testClusterMatchesOneProcessAndIsPrivate(tmp_path, single_process):
  """R=2 replicas x K=2 cells on 4 worker processes vs 4 devices in one.

  The cluster syncs gradients with collective all-reduce across worker tasks
  (task.gradient_sync 'all_reduce'), the one process with Lingvo's shared
  variables: both must give the numbers of one large batch.
  """
  logdir = str(tmp_path / 'cluster')
  with _Launch(
      logdir, '--workers=4', '--worker_split_size=2', '--max_steps=3',
      '--trace_train_step=2',
      '--model_params_override=task.gradient_sync:"all_reduce"') as run:
    m = run.WaitFor(r'launch: all 6 tasks are serving: (\S+)', 240)
    jobs = cluster.ParseClusterSpec(m.group(1))
    pids = run.Pids()
    # What TensorFlow binds: the wildcard address (all interfaces) ...
    listeners = _ListeningSockets(pids['worker task 0'])
    port0 = cluster.Port(jobs['worker'][0])
    assert ('0' * 32, port0) in listeners or ('0' * 8, port0) in listeners
    # ... in a namespace whose only interface is loopback.
    with open(f'/proc/{pids["worker task 0"]}/net/dev') as f:
      devs = [l.split(':')[0].strip() for l in f.readlines()[2:]]
    assert devs == ['lo'], devs
    # So from this (the host's) network, no task's port answers.
    for address in sum(jobs.values(), []):
      for host in ['127.0.0.1'] + _NonLoopbackIPv4():
        assert _Refused(host, cluster.Port(address)), (host, address)
    assert run.Wait(300) == 0, run.Tail()
  out = run.Text()
  assert 'replica 1 cell 1 on /job:worker/replica:0/task:3/device:CPU:0' in out

  # Placement from the step stats of training step 2: every op of cell i
  # (name scope d<i>_mb<t>) of replica r (replica_<r>: gradient_sync's
  # per-replica graph), forward and backward, ran on worker task r*2+i.
  metadata = tf.RunMetadata()
  with open(os.path.join(logdir, 'train', 'run_metadata_step_2.pb'),
            'rb') as f:
    metadata.ParseFromString(f.read())
  seen = collections.defaultdict(set)
  collectives = collections.Counter()
  for dev in metadata.step_stats.dev_stats:
    task = re.search(r'/job:worker/replica:0/task:(\d+)/', dev.device)
    where = int(task.group(1)) if task else dev.device
    for node in dev.node_stats:
      if re.search(r'= CollectiveReduceV2\(', node.timeline_label):
        collectives[where] += 1
      m = re.search(r'/replica_(\d+)/d(\d+)_mb\d+/', node.node_name)
      if m:
        kind = ('backward' if node.node_name.startswith('gradients/') else
                'forward')
        seen[(int(m.group(1)), int(m.group(2)), kind)].add(where)
  want = {(r, i, kind): {2 * r + i} for r in range(2) for i in range(2)
          for kind in ('forward', 'backward')}
  assert dict(seen) == want, dict(seen)
  # The dense gradients' all-reduce ran on all 4 worker tasks (one group per
  # pipeline stage: tasks {0, 2} and {1, 3}), the same count on the two
  # replicas of a stage.
  assert set(collectives) == {0, 1, 2, 3}, collectives
  assert collectives[0] == collectives[2] > 0, collectives
  assert collectives[1] == collectives[3] > 0, collectives

  # The same experiment in one process with the same 4 logical devices.
  _AssertSameNumbers(logdir, single_process)


@pytest.mark.e2e
def testHybridAcrossProcessesMatchesOneProcess(tmp_path, single_process):
  """R=2 x K=2 under 'hybrid' on 4 worker processes vs one process.

  The embedding's sparse gradients go through SparseConditionalAccumulators
  on the ps tasks (in sync mode, the worker tasks), the dense ones through
  collective all-reduce.
  """
  logdir = str(tmp_path / 'hybrid')
  with _Launch(logdir, '--workers=4', '--worker_split_size=2',
               '--max_steps=3', '--trace_train_step=2',
               '--model_params_override=task.gradient_sync:"hybrid"') as run:
    assert run.Wait(300) == 0, run.Tail()
  metadata = tf.RunMetadata()
  with open(os.path.join(logdir, 'train', 'run_metadata_step_2.pb'),
            'rb') as f:
    metadata.ParseFromString(f.read())
  ops = collections.defaultdict(set)
  for dev in metadata.step_stats.dev_stats:
    task = re.search(r'/job:worker/replica:0/task:(\d+)/', dev.device)
    for node in dev.node_stats:
      m = re.search(r'= (SparseAccumulator\w+|CollectiveReduceV2)\(',
                    node.timeline_label)
      if m:
        ops[m.group(1)].add(int(task.group(1)) if task else dev.device)
  assert ops['SparseAccumulatorApplyGradient'], dict(ops)
  assert ops['SparseAccumulatorTakeGradient'], dict(ops)
  assert ops['CollectiveReduceV2'] == {0, 1, 2, 3}, dict(ops)
  assert all(isinstance(t, int) for v in ops.values() for t in v), dict(ops)
  _AssertSameNumbers(logdir, single_process)


def _CheckpointSteps(logdir):
  state = tf.train.get_checkpoint_state(os.path.join(logdir, 'train'))
  return [int(p.rsplit('-', 1)[1]) for p in state.all_model_checkpoint_paths]


def _WaitForCheckpoint(logdir, above, run, timeout_s):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    state = tf.train.get_checkpoint_state(os.path.join(logdir, 'train'))
    if state and int(state.model_checkpoint_path.rsplit('-', 1)[1]) > above:
      return int(state.model_checkpoint_path.rsplit('-', 1)[1])
    assert run.proc.poll() is None, run.Tail()
    time.sleep(0.2)
  raise AssertionError(f'no checkpoint after step {above} in {timeout_s} s:\n'
                       + run.Tail())


def _Step(run):
  """The last training step the trainer client printed."""
  steps = re.findall(r'\[trainer_client\] step (\d+)/', run.Text())
  return int(steps[-1]) if steps else 0


@pytest.mark.e2e
def testKilledHungAndRestartedTasksKeepTheStepCounter(tmp_path):
  """One run: worker kill -9, hung worker, controller and trainer kills.

  Training must go on to --max_steps with exit code 0, resuming the weights
  of the last checkpoint after the lost worker, while the step counter never
  goes back: no step number is trained (summarized) twice and checkpoint
  steps only increase.
  """
  logdir = str(tmp_path / 'log')
  # A checkpoint every second: the first kill comes after ~50 steps, not
  # the ~500 of the experiment's 5 s; the trainer hardly steps between the
  # kills (it waits on the lost tasks), and 400 steps leave it far from the
  # end when the last kill comes.
  max_steps, timeout_s = 400, 20
  with _Launch(logdir, '--workers=2', '--worker_split_size=2',
               f'--max_steps={max_steps}', f'--worker_timeout_secs={timeout_s}',
               # The clients' own deadline is checked here: the launcher
               # replaces a hung task only after its --task_timeout_secs.
               '--task_timeout_secs=600', '--max_restarts=8',
               '--model_params_override=train.save_interval_seconds:1') as run:
    run.WaitFor(r'launch: all 4 tasks are serving', 300)
    _WaitForCheckpoint(logdir, 0, run, 120)
    os.kill(run.Pids()['worker task 1'], signal.SIGKILL)
    step_at_kill = _Step(run)
    run.WaitFor(r'launch: worker task 1 .* is gone \(signal SIGKILL\); '
                r'restarting it', 30)
    # The clients name the lost task within --worker_timeout_secs.
    run.WaitFor(r'(trainer_client|controller): lost contact with .*worker task '
                r'1 \(/job:worker/replica:0/task:1 at ', 90)
    # The restarted worker's variables are uninitialized: the controller
    # restores the weights of the last checkpoint, not the step counter.
    m = run.WaitFor(r'controller: .*restored the weights of ckpt-\d+ \(saved '
                    r'at step (\d+)\); the step counter goes on from (\d+)',
                    180)
    assert int(m.group(1)) <= int(m.group(2)), m.group(0)
    # A hung worker (stopped, its connections open): the trainer reports it
    # after --worker_timeout_secs instead of waiting forever.
    n = len(run.lines)
    os.kill(run.Pids()['worker task 0'], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
      deadline = stopped + timeout_s + 60
      while time.monotonic() < deadline:
        hung = [l for l in run.lines[n:] if re.search(
            r'trainer_client: lost contact with worker task 0 '
            r'\(/job:worker/replica:0/task:0 at .*DeadlineExceeded', l)]
        if hung:
          break
        time.sleep(0.2)
      assert hung, run.Tail()
    finally:
      os.kill(run.Pids()['worker task 0'], signal.SIGCONT)
    # A killed controller: the workers keep the variables; its restart goes
    # on saving checkpoints from there.
    os.kill(run.Pids()['controller task 0'], signal.SIGKILL)
    run.WaitFor(r'launch: controller task 0 .* is gone', 30)
    # A killed trainer client: its restart goes on from the workers' step.
    trainer_pid = run.Pids()['trainer_client task 0']
    os.kill(trainer_pid, signal.SIGKILL)
    run.WaitFor(r'launch: trainer_client task 0 .* is gone', 30)
    steps_at = dict(worker_kill=step_at_kill, trainer_kill=_Step(run))
    assert run.Wait(600) == 0, run.Tail()
    with open(tmp_path / 'launch.out', 'w') as f:
      f.write(run.Text())
  out = run.Text()
  for task in ('worker task 1', 'controller task 0', 'trainer_client task 0'):
    assert len(re.findall(rf'launch: started {task} ', out)) >= 2, task
  assert 0 < steps_at['trainer_kill'] < max_steps, steps_at
  steps = _CheckpointSteps(logdir)
  assert steps == sorted(set(steps)) and steps[-1] == max_steps, steps
  saved = []
  for step in steps:  # Every kept checkpoint is whole: every tensor reads.
    reader = _Checkpoint(logdir, step)
    for name in reader.get_variable_to_shape_map():
      reader.get_tensor(name)
    saved.append(int(reader.get_tensor('global_step')))
  # The controller names a checkpoint by the step it read just before saving
  # while the trainer goes on, so the saved step may differ by a few steps;
  # it never goes backwards.
  assert saved == sorted(saved) and saved[-1] == max_steps, saved
  assert all(abs(a - b) <= 50 for a, b in zip(saved, steps)), (saved, steps)
  # No step number was trained twice (each summarized loss is a new step),
  # and training reached --max_steps. (A killed trainer loses the summaries
  # it had not flushed yet, so some steps may have none.)
  loss = _Scalars(os.path.join(logdir, 'train'), 'loss')
  twice = {s: v for s, v in loss.items() if len(v) > 1}
  assert not twice, twice
  assert max(loss) == max_steps


def _Trainer(*flags, timeout=120, private=True):
  """The trainer's exit code and output; private: in a network namespace of
  its own (only 127.0.0.1)."""
  cmd = (['-c', proc_testlib.PRIVATE_TRAINER] if private else
         ['-m', 'lingvo_ext.trainer'])
  proc = zygote.run(
      [sys.executable, *cmd, f'--model={MODEL}',
       '--logdir=/tmp/unused_lingvo_ext', *flags], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=timeout, check=False)
  return proc.returncode, proc.stdout


def testClusterSpecErrorsNameTheFlagAndTheFix():
  spec = 'controller=127.0.0.1:2220@trainer_client=127.0.0.1:2221'
  jobs = cluster.ParseClusterSpec(spec)
  with pytest.raises(ValueError, match=r"--cluster_spec has no 'worker' job, "
                     r'which --mode=sync needs; add @worker=host:port'):
    cluster.CheckClusterFlags(jobs, 'sync', ['trainer_client'], 0)
  jobs = cluster.ParseClusterSpec(spec + '@worker=127.0.0.1:2222')
  with pytest.raises(ValueError, match=r"--job=ps but --cluster_spec has no "
                     r"'ps' job"):
    cluster.CheckClusterFlags(jobs, 'sync', ['ps'], 0)
  with pytest.raises(ValueError, match=r"--task=1 but --cluster_spec lists 1 "
                     r"'worker' task"):
    cluster.CheckClusterFlags(jobs, 'sync', ['worker'], 1)
  with pytest.raises(ValueError, match=r'--worker_split_size=2 is larger than '
                     r'the 1 device\(s\) the workers offer .*add worker tasks '
                     r'to --cluster_spec .* or lower --worker_split_size'):
    cluster.MakeWorkerLayout(1, 1, 2)
  with pytest.raises(ValueError, match=r'--worker_split_size=2 does not divide '
                     r'the 3 devices'):
    cluster.MakeWorkerLayout(3, 1, 2)
  with pytest.raises(ValueError, match=r'worker task 0 and worker task 1 both '
                     r'use 127.0.0.1:2222; two processes cannot serve one port'):
    cluster.ParseClusterSpec('worker=127.0.0.1:2222,127.0.0.1:2222')
  with pytest.raises(ValueError, match=r"--cluster_spec: bad address "
                     r"'127.0.0.1' in job 'worker'; write host:port"):
    cluster.ParseClusterSpec('worker=127.0.0.1')
  layout = cluster.MakeWorkerLayout(4, 1, 2)
  assert layout.num_replicas == 2
  assert [layout.Task(r, i) for r in range(2) for i in range(2)] == [0, 1, 2, 3]
  assert cluster.MakeWorkerLayout(2, 2, 4).Device(0, 3) == (
      '/job:worker/replica:0/task:1/device:CPU:1')


@pytest.mark.e2e
def testWorkerReplicasMustAgreeWithTheClusterSpec():
  # --worker_replicas reaches CheckFlags as a value (the trainer reads FLAGS).
  from lingvo_ext.runtime import trainer_flags  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import trainer_lib  # pylint: disable=g-import-not-at-top
  o = trainer_flags.Options(
      cluster_spec='controller=127.0.0.1:2220@trainer_client=127.0.0.1:2221'
      '@worker=127.0.0.1:2222,127.0.0.1:2223', job='worker', task=0)
  assert trainer_lib.CheckFlags(o) is None
  assert trainer_lib.CheckFlags(o, worker_replicas=2) is None
  error = trainer_lib.CheckFlags(o, worker_replicas=3)
  assert error.startswith('--worker_replicas=3 disagrees with --cluster_spec')
  assert len(error.splitlines()) == 1


# Runs the trainer and the launcher (forked): end-to-end by pytest.ini.
@pytest.mark.e2e
def testTrainerAndLaunchReportBadInputInOneLine():
  from lingvo_ext.distributed import network  # pylint: disable=g-import-not-at-top
  free = network.FreePorts(3)
  # The trainer: exit code 2 and one line naming the flag.
  spec = f'trainer_client=127.0.0.1:{free[1]}'
  rc, out = _Trainer(f'--cluster_spec={spec}', '--job=trainer_client')
  assert rc == 2, out[-2000:]
  assert ("error: --cluster_spec has no 'worker' job, which --mode=sync "
          'needs') in out
  # The launcher checks the split against --workers before starting anything.
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.launch', f'--model={MODEL}',
       '--logdir=/tmp/unused_lingvo_ext', '--workers=1',
       '--worker_split_size=2'], cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, timeout=60, check=False)
  assert proc.returncode == 2
  assert '--worker_split_size=2 is larger than the 1 device(s)' in proc.stdout
  # A port nobody serves: the client gives up, naming it.
  dead = f'127.0.0.1:{free[2]}'
  spec = f'trainer_client=127.0.0.1:{free[1]}@worker={dead}'
  rc, out = _Trainer(f'--cluster_spec={spec}', '--job=trainer_client',
                     '--cluster_wait_secs=3')
  assert rc != 0
  assert (f'no answer within --cluster_wait_secs=3 s from worker task 0 at '
          f'{dead}') in out, out[-2000:]
  # A port another process holds.
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    s.listen()
    taken = f'127.0.0.1:{s.getsockname()[1]}'
    spec = f'trainer_client=127.0.0.1:{free[1]}@worker={taken}'
    # In this network, where the port is taken (it fails before binding).
    rc, out = _Trainer(f'--cluster_spec={spec}', '--job=worker',
                       private=False)
  assert rc != 0
  assert (f'port {cluster.Port(taken)} of worker task 0 ({taken} in '
          '--cluster_spec) is already in use by another process') in out
