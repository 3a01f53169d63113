"""The trainer fails loudly and safely: NaN, damaged checkpoints, Ctrl-C, bad
flags and params. Each runs `python -m lingvo_ext.trainer` in a subprocess
on the Tiny LM for a few steps.
"""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import lingvo.compat as tf
import numpy as np
import pytest

from tests.support import ROOT
from tests.support import proc_testlib
from tests.support import zygote

TIMEOUT = 300
MODEL = '--model=lm.TransformerLmTiny'


def _Run(*args):
  proc = zygote.run([sys.executable, '-m', 'lingvo_ext.trainer', *args],
                    cwd=ROOT, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
                    check=False)
  return proc.returncode, proc.stdout


def _Checkpoints(logdir):
  return sorted(glob.glob(os.path.join(logdir, 'train', 'ckpt-*.index')))


def _Latest(logdir):
  return tf.train.latest_checkpoint(os.path.join(logdir, 'train'))


def testFiniteChecksNameExactlyTheNonFiniteFloatVariables():
  # Random ranks (0-3, and one of unknown shape), shapes and dtypes; NaN, Inf
  # or -Inf at a random element of a random subset of the float variables.
  from lingvo_ext import checkpoints  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  with tf.Graph().as_default():
    variables, values = [], {}
    for i in range(40):
      shape = list(rng.randint(1, 4, size=rng.randint(0, 4)))
      dtype = [tf.float32, tf.float64, tf.bfloat16, tf.int32][i % 4]
      v = tf.Variable(tf.zeros(shape, dtype), name='v%d' % i,
                      shape=tf.TensorShape(None) if i == 5 else shape)
      variables.append(v)
      if dtype.is_floating and rng.rand() < 0.4:
        value = np.zeros(shape, np.float64)
        value.flat[rng.randint(value.size)] = rng.choice(
            [np.nan, np.inf, -np.inf])
        values[v.op.name] = (v, value)
    checks = checkpoints.FiniteChecks(variables)
    assert [n for n, _ in checks] == [
        v.op.name for v in variables if v.dtype.base_dtype.is_floating]
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      assert checkpoints.NonFiniteVariables(sess, checks) == []
      for v, value in values.values():
        v.load(value.astype(v.dtype.base_dtype.as_numpy_dtype), sess)
      bad = checkpoints.NonFiniteVariables(sess, checks)
  assert len(values) > 5
  assert bad == [v.op.name for v in variables if v.op.name in values]


@pytest.mark.e2e
def testNonFiniteLossStopsWithoutANonFiniteCheckpoint(tmp_path):
  # A float32-infinite learning rate makes the first update Inf; the next
  # steps are NaN.
  logdir = str(tmp_path)
  rc, out = _Run(MODEL, f'--logdir={logdir}', '--max_steps=50',
                 '--max_nonfinite_steps=2',
                 '--model_params_override=task.train.learning_rate:1e39')
  assert rc == 3, out[-3000:]
  m = re.search(r'error: training stopped at step (\d+): .* in 2 tries '
                r'\(--max_nonfinite_steps=2\)\. First non-finite: variable '
                r'(\S+)\. Last good checkpoint: (\S+)\. ', out)
  assert m, out[-3000:]
  # One line for one fault on the console; the log file has it too.
  said = [l for l in out.splitlines() if 'training stopped at step' in l]
  assert said == [m.string[m.start():].splitlines()[0]], said
  with open(os.path.join(logdir, 'log.controller+trainer_client.txt')) as f:
    assert re.search(r'^E.*training stopped at step 2: ', f.read(), re.M)
  assert int(m.group(1)) == 2
  assert m.group(3) == _Latest(logdir)
  assert _Checkpoints(logdir)
  for index in _Checkpoints(logdir):
    reader = tf.train.load_checkpoint(index[:-len('.index')])
    for name in reader.get_variable_to_shape_map():
      value = reader.get_tensor(name)
      if np.issubdtype(np.asarray(value).dtype, np.floating):
        assert np.all(np.isfinite(value)), (index, name)


@pytest.mark.e2e
def testDamagedLatestCheckpointFallsBackToTheNewestIntactOne(
    tmp_path, tiny_gpipe_run):
  # A copy of a finished 3-step run (conftest.py).
  logdir = tiny_gpipe_run.Copy(str(tmp_path / 'log'))
  model = [f'--model={tiny_gpipe_run.model}', *tiny_gpipe_run.flags]
  steps = [int(re.search(r'ckpt-(\d+)', p).group(1))
           for p in _Checkpoints(logdir)]
  assert steps[0] == 0 and steps[-1] == 3, steps
  latest = _Latest(logdir)
  assert latest.startswith(logdir), latest
  data = glob.glob(latest + '.data-*')[0]
  with open(data, 'r+b') as f:
    f.truncate(os.path.getsize(data) // 2)
  log = os.path.join(logdir, 'log.controller+trainer_client.txt')
  logged = os.path.getsize(log)  # What the first run logged.
  rc, out = _Run(*model, f'--logdir={logdir}', '--max_steps=5')
  assert rc == 0, out[-3000:]
  previous = latest.replace('ckpt-00000003', 'ckpt-%08d' % steps[-2])
  lines = [l for l in out.splitlines()
           if l.startswith('warning: skipped damaged checkpoint')]
  assert len(lines) == 1, out[-3000:]
  assert lines[0].startswith(
      f'warning: skipped damaged checkpoint {latest} (unreadable: '), lines
  assert lines[0].endswith(f'); using {previous}.'), lines
  with open(log, 'rb') as f:
    f.seek(logged)
    assert f'Restored {steps[-2]} ' in f.read().decode('utf-8')
  assert _Latest(logdir).endswith('ckpt-00000005')


@pytest.mark.e2e
def testCtrlCSavesACheckpoint(tmp_path):
  logdir = str(tmp_path)
  log = str(tmp_path / 'out.txt')
  # No periodic checkpoint after the first: any later one is Ctrl-C's.
  proc = proc_testlib.Start([
      sys.executable, '-m', 'lingvo_ext.trainer', MODEL,
      f'--logdir={logdir}', '--max_steps=1000000',
      '--model_params_override=train.save_interval_seconds:3600'
  ], log)
  try:
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
      assert proc.poll() is None, open(log).read()[-3000:]
      with open(log) as f:  # Progress lines: 'step N/1000000  loss ...'.
        if any(int(s) >= 5 for s in re.findall(r'step (\d+)/', f.read())):
          break
      time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=TIMEOUT)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  with open(log) as f:
    out = f.read()
  assert rc == 130, out[-3000:]
  latest = _Latest(logdir)
  step = int(latest.rsplit('-', 1)[1])
  assert step >= 5, out[-3000:]
  assert f'interrupted: the last checkpoint is {latest}' in out


@pytest.mark.e2e
def testBadLogdirAndParamsAreOneLineErrors(tmp_path):
  a_file = str(tmp_path / 'a_file')
  with open(a_file, 'w') as f:
    f.write('x')
  cases = [
      ([f'--logdir={a_file}'], f'--logdir={a_file} is a file'),
      ([f'--logdir={a_file}/sub'], f'--logdir={a_file}/sub is not writable'),
      ([f'--logdir={tmp_path}/new', '--model=lm.TransformerLmTinyGPipe',
        '--model_params_override=task.num_micro_batches:3'],
       'error: lm: the global batch 8 (input.batch_size=8 per replica x 1 '
       'replicas) is not divisible by replicas x micro-batches = 1 x 3; set '
       'task.input.batch_size to a multiple of num_micro_batches=3.'),
  ]
  for flags, message in cases:
    if not any(f.startswith('--model=') for f in flags):
      flags = [MODEL] + flags
    rc, out = _Run(*flags, '--max_steps=1')
    assert rc == 2, out[-3000:]
    assert message in out, out[-3000:]
    assert 'Traceback' not in out, out[-3000:]
  assert not os.path.exists(str(tmp_path / 'new' / 'train' / 'checkpoint'))
  shutil.rmtree(str(tmp_path / 'new'), ignore_errors=True)


@pytest.mark.e2e
def testWaitingJobsSayWhatTheyWaitFor(tmp_path):
  # A trainer without its controller, and an evaler without checkpoints.
  logdir = str(tmp_path)
  log = str(tmp_path / 'out.txt')
  proc = proc_testlib.Start([
      sys.executable, '-m', 'lingvo_ext.trainer', MODEL,
      f'--logdir={logdir}', '--job=trainer_client,evaler_dev'
  ], log)
  expected = [
      'trainer: waiting for the controller to initialize or restore the '
      'variables',
      'evaler_dev: waiting for a first checkpoint in '
      f'{os.path.join(logdir, "train")}',
  ]
  try:
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
      assert proc.poll() is None, open(log).read()[-3000:]
      with open(log) as f:
        out = f.read()
      if all(e in out for e in expected):
        break
      time.sleep(0.5)
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  for e in expected:
    assert e in out, out[-3000:]


def testEvalerAndDecoderUseTheTrainersSplits():
  # Pipelined over 2 CPU devices, the trainer runs one 2-device split; the
  # evaler and decoder must too, not two 1-device splits of a full batch
  # each (twice the training batch).
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top

  from lingvo_ext.runtime import runners  # pylint: disable=g-import-not-at-top
  flags = tf.flags.FLAGS
  if not flags.is_parsed():
    flags.mark_as_parsed()
  names = ('num_cpu_devices', 'worker_split_size', 'evaler_replicas',
           'decoder_replicas', 'run_locally', 'mode')
  saved = {n: flags[n].value for n in names}
  try:
    # The trainer's flags (its defaults: --run_locally=cpu --mode=sync).
    for n, v in zip(names, (2, 2, 1, 1, 'cpu', 'sync')):
      setattr(flags, n, v)
    manager = runners.RunnerManager('lm.TransformerLmTinyGPipe')
    splits = {}
    for job in ('trainer_client', 'evaler', 'decoder'):
      params = cluster_factory.Cluster.Params()
      manager.UpdateClusterParamsFromFlags(params, job)
      cluster = cluster_factory.Cluster(params)
      splits[job] = (cluster.num_splits_per_client,
                     cluster.num_devices_per_split)
  finally:
    for n, v in saved.items():
      setattr(flags, n, v)
  assert splits == {job: (1, 2) for job in splits}, splits


def testProgressLineHasStepLossRatesAndEta():
  from lingvo_ext.runtime import progress  # pylint: disable=g-import-not-at-top
  now = [100.0]
  p = progress.Progress(1000, clock=lambda: now[0])
  assert p.Line(1, 4.5, 8) == 'step 1/1000  loss 4.5000  (measuring speed)'
  for step in range(2, 11):
    now[0] += 0.5
    line = p.Line(step, 2.0, 8)
  # 9 steps and 72 examples in 4.5 s: 2 steps/s, 990 steps left.
  assert line == ('step 10/1000  loss 2.0000  2.00 steps/s  16.0 examples/s  '
                  'ETA 8m15s'), line
  assert progress.FormatDuration(3725) == '1h02m'
