"""End-to-end tests of `python -m lingvo_ext.trainer` in subprocesses.

Each Tiny experiment trains for a few dozen steps, then a second run with a
higher --max_steps resumes from the first run's last checkpoint. Runs are
kept short: each costs two graph builds (controller and trainer).
"""

import glob
import os
import re
import subprocess
import sys
import threading
import time

import lingvo.compat as tf
import numpy as np
import pytest

from tests.support import ROOT
from tests.support import events_testlib
from tests.support import proc_testlib
from tests.support import zygote

TIMEOUT = 300


def _Run(*args, merge_stderr=True):
  """Runs a lingvo_ext module; returns (returncode, stdout [+ stderr])."""
  proc = zygote.run([sys.executable, '-m', *args],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT if merge_stderr else None,
                    text=True,
                    timeout=TIMEOUT,
                    check=False)
  return proc.returncode, proc.stdout


def _Train(model, logdir, *flags):
  rc, out = _Run('lingvo_ext.trainer', f'--model={model}', f'--logdir={logdir}',
                 *flags)
  assert rc == 0, out[-5000:]
  return out


def _Log(logdir, job='controller,trainer_client'):
  """The trainer's full Lingvo log in `logdir` (all runs appended)."""
  name = 'log.%s.txt' % job.replace(',', '+')
  with open(os.path.join(logdir, name), encoding='utf-8') as f:
    return f.read()


def _Checkpoints(logdir):
  return sorted(
      int(m.group(1)) for m in (re.search(r'ckpt-(\d+)\.index$', p) for p in
                                glob.glob(os.path.join(logdir, 'train', '*')))
      if m)


def _CheckTrains(model, logdir, steps):
  """A new run of `steps` steps; returns its {step: loss}."""
  out = _Train(model, logdir, f'--max_steps={steps}')
  # A short, readable output: progress lines; Lingvo's log is in a file.
  assert re.search(rf'\nstep {steps}/{steps}  loss [\d.]+  [\d.]+ steps/s  '
                   r'[\d.]+ examples/s  ETA 0s\n', out), out[-3000:]
  assert 'Place variable' not in out and 'Place variable' in _Log(logdir)
  loss = events_testlib.Scalars(os.path.join(logdir, 'train'), 'loss')
  assert sorted(loss) == list(range(1, steps + 1))
  first = np.mean([loss[s] for s in range(1, 6)])
  last = np.mean([loss[s] for s in range(steps - 4, steps + 1)])
  assert last < first - 0.1, loss
  assert _Checkpoints(logdir)[-1] == steps
  return loss


def _CheckTrainsAndResumes(model, logdir, steps, more_steps):
  loss = _CheckTrains(model, logdir, steps)
  _Train(model, logdir, f'--max_steps={more_steps}')
  assert f'Restored {steps} ' in _Log(logdir)
  resumed = events_testlib.Scalars(os.path.join(logdir, 'train'), 'loss')
  assert min(s for s in resumed if s not in loss) == steps + 1
  assert max(resumed) == more_steps
  assert _Checkpoints(logdir)[-1] == more_steps
  return loss


@pytest.fixture(scope='module')
def lm_run(shared_once):
  """The Tiny LM trained (K=1) and resumed; returns (logdir, step losses).

  Built once for all test workers (conftest.py); the tests' evaler and
  decoder jobs write subfolders of their own.
  """
  def Build(logdir):
    os.makedirs(logdir)
    loss = _CheckTrainsAndResumes('lm.TransformerLmTiny', logdir, 20, 26)
    return logdir, sorted(loss.items())

  logdir, loss = shared_once('lm_run', Build)
  return logdir, dict(loss)


@pytest.mark.e2e
def testLmTrainsAndResumes(lm_run):
  logdir, _ = lm_run
  assert os.path.exists(os.path.join(logdir, 'train', 'vocab.json'))
  assert glob.glob(os.path.join(logdir, 'control', 'events.out.*'))


@pytest.mark.e2e
def testLmEvalerScoresTheDevSplit(lm_run):
  logdir, _ = lm_run
  _Train('lm.TransformerLmTiny', logdir, '--max_steps=26', '--job=evaler_dev')
  eval_dir = os.path.join(logdir, 'eval_dev')
  log_pplx = events_testlib.Scalars(eval_dir, 'log_pplx')
  assert list(log_pplx) == [26]
  assert 0 < log_pplx[26] < np.log(128)
  assert os.path.exists(os.path.join(eval_dir, 'score-00000026.txt'))


def _TextSummaries(event_dir):
  """{tag: [text]} of the text summaries in `event_dir`."""
  texts = {}
  for path in sorted(glob.glob(os.path.join(event_dir, 'events.out.*'))):
    for event in tf.train.summary_iterator(path):
      for v in event.summary.value:
        if v.metadata.plugin_data.plugin_name == 'text':
          texts.setdefault(v.tag, []).append(
              v.tensor.string_val[0].decode('utf-8'))
  return texts


@pytest.mark.e2e
def testLmDecoderSamplesContinuationsOfDevPrefixes(lm_run):
  logdir, _ = lm_run
  _Train('lm.TransformerLmTiny', logdir, '--max_steps=26',
         '--job=decoder_dev')
  dec_dir = os.path.join(logdir, 'decoder_dev')
  with open(os.path.join(dec_dir, 'samples-00000026.txt')) as f:
    text = f.read()
  # decoder_samples_per_summary=16: two dev batches of 8; prefixes are the
  # first seq_len // 2 = 16 characters of each dev window.
  examples = re.findall(r"example (\d+)\n  prefix:   (.*)\n  sample:   (.*)\n"
                        r"  dev text: (.*)\n", text)
  assert [int(e[0]) for e in examples] == list(range(16)), text[:2000]
  for _, prefix, sample, truth in examples:
    assert len(eval(prefix)) == 16 and len(eval(truth)) == 16  # pylint: disable=eval-used
    assert eval(sample)  # pylint: disable=eval-used
  texts = _TextSummaries(dec_dir)
  assert examples[0][1][1:-1] in texts['samples'][0], texts


@pytest.mark.e2e
def testLmTwoPartitionsOnTwoCpusMatchOnePartition(lm_run, tiny_gpipe_run):
  # tiny_gpipe_run: lm.TransformerLmTinyGPipe on --num_cpu_devices=2
  # --worker_split_size=2 (conftest.py).
  _, loss_k1 = lm_run
  logdir = tiny_gpipe_run.logdir
  assert 'device:CPU:1' in _Log(logdir)
  # The 2 devices share one intra-op pool of cores / 2 threads.
  threads = max(1, len(os.sched_getaffinity(0)) // 2)
  assert f'intra-op threads: {threads} (--intra_op_threads)' in _Log(logdir)
  loss_k2 = events_testlib.Scalars(os.path.join(logdir, 'train'), 'loss')
  print(f'first-step loss: K=1 {loss_k1[1]:.7f}, K=2 {loss_k2[1]:.7f}')
  assert abs(loss_k1[1] - loss_k2[1]) < 1e-4


def _LatestCheckpointStep(logdir):
  path = tf.train.latest_checkpoint(os.path.join(logdir, 'train'))
  return int(path.rsplit('-', 1)[1]) if path else -1


@pytest.mark.e2e
def testImageTrainsResumesAndSurvivesAKill(tmp_path):
  logdir = str(tmp_path / 'log')
  model = 'image.ConvClassifierTiny'
  _CheckTrains(model, logdir, 30)

  # A long run resumes from step 30; kill it once it has checkpointed past
  # step 30 (every second here; the Tiny experiments' 5 s would train 5 s
  # for nothing), then restart it.
  out_path = str(tmp_path / 'killed.out')
  proc = proc_testlib.Start([
      sys.executable, '-m', 'lingvo_ext.trainer', f'--model={model}',
      f'--logdir={logdir}', '--max_steps=1000000',
      '--model_params_override=train.save_interval_seconds:1'
  ], out_path, os.devnull)
  try:
    deadline = time.time() + TIMEOUT
    while _LatestCheckpointStep(logdir) <= 30 and time.time() < deadline:
      assert proc.poll() is None, 'the trainer exited early'
      time.sleep(0.5)
  finally:
    proc.kill()
    proc.wait()
  assert 'Restored 30 ' in _Log(logdir)
  with open(out_path) as f:  # The first step's progress line is printed.
    resumed = [int(s) for s in re.findall(r'^step (\d+)/1000000 ', f.read(),
                                           re.MULTILINE)]
  assert resumed and resumed[0] == 31, resumed
  step = _LatestCheckpointStep(logdir)
  assert step > 30
  out = _Train(model, logdir, f'--max_steps={step + 3}')
  assert f'Restored {step} ' in _Log(logdir)
  assert re.search(rf'\nstep {step + 3}/{step + 3}  ', out), out[-3000:]
  assert _LatestCheckpointStep(logdir) == step + 3

  # The decoder's confusion matrix covers the whole dev split (every 5th of
  # the 1797 digits) and agrees with its accuracy and per-class scalars.
  _Train(model, logdir, f'--max_steps={step + 3}', '--job=decoder_dev')
  dec_dir = os.path.join(logdir, 'decoder_dev')
  with open(os.path.join(dec_dir, 'confusion-%08d.txt' % (step + 3))) as f:
    text = f.read()
  rows = re.findall(r'^ +(\d+)((?: +\d+){10})$', text, re.MULTILINE)
  matrix = np.array([[int(x) for x in r[1].split()] for r in rows])
  assert matrix.shape == (10, 10) and matrix.sum() == 360, text
  accuracy = events_testlib.Scalars(dec_dir, 'confusion')[step + 3]
  assert abs(accuracy - np.trace(matrix) / 360) < 1e-6
  for i in range(10):
    per_class = events_testlib.Scalars(
        dec_dir, f'confusion/class_{i}')[step + 3]
    assert abs(per_class - matrix[i, i] / matrix[i].sum()) < 1e-6
    assert re.search(rf'^ +{i} +{matrix[i].sum()} +{per_class:.4f}$', text,
                     re.MULTILINE)
  assert 'confusion/matrix' in _TextSummaries(dec_dir)


def testImportedAsALibraryTheTrainerLeavesTheCollectorOn():
  # Only run as the program does it turn the collector off while it imports
  # (tests/e2e/test_user_experiment.py checks that run).
  import gc  # pylint: disable=g-import-not-at-top

  from lingvo_ext import trainer  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  assert gc.isenabled()


@pytest.mark.e2e
def testListModels():
  rc, out = _Run('lingvo_ext.tools.list_models', merge_stderr=False)
  assert rc == 0, out
  names = out.split('\n')[:-1]  # One name a line, nothing else.
  for name in ('lm.TransformerLm', 'lm.TransformerLmTiny',
               'lm.TransformerLmGPipe', 'lm.TransformerLmTinyGPipe',
               'image.ConvClassifier', 'image.ConvClassifierTiny',
               'image.ConvClassifierGPipe', 'image.ConvClassifierTinyGPipe'):
    assert name in names
  assert names == sorted(names)


@pytest.mark.e2e
def testUnknownModelIsAClearError(tmp_path):
  rc, out = _Run('lingvo_ext.trainer', '--model=lm.TransformerLmTinny',
                 f'--logdir={tmp_path}')
  assert rc == 2
  assert "Unknown model 'lm.TransformerLmTinny'" in out
  assert 'lm.TransformerLmTiny\n' in out
  assert 'Traceback' not in out
  assert not os.listdir(str(tmp_path))


@pytest.mark.e2e
def testBadSplitSizeIsAClearError(tmp_path):
  rc, out = _Run('lingvo_ext.trainer', '--model=lm.TransformerLmTiny',
                 f'--logdir={tmp_path}', '--worker_split_size=2')
  assert rc == 2
  assert '--num_cpu_devices=2' in out
  assert 'Traceback' not in out


def testIntraOpThreadsDefaultToCoresPerDevice():
  from lingvo_ext.runtime import trainer_flags  # pylint: disable=g-import-not-at-top
  o = trainer_flags.Options
  local = dict(run_locally='cpu')
  assert o(num_cpu_devices=2, **local).IntraOpThreads(cores=2) == 1
  assert o(num_cpu_devices=2, **local).IntraOpThreads(cores=8) == 4
  assert o(num_cpu_devices=4, **local).IntraOpThreads(cores=2) == 1
  # One device, or not a local run: TensorFlow's default.
  assert o(num_cpu_devices=1, **local).IntraOpThreads(cores=8) == 0
  assert o(num_cpu_devices=2).IntraOpThreads(cores=8) == 0
  # --plan=auto runs on --devices.
  assert o(num_cpu_devices=1, plan='auto', devices=4,
           **local).IntraOpThreads(cores=8) == 2
  # The flag wins, 0 included.
  assert o(num_cpu_devices=2, intra_op_threads=0,
           **local).IntraOpThreads(cores=8) == 0
  assert o(num_cpu_devices=1, intra_op_threads=3,
           **local).IntraOpThreads(cores=8) == 3
  # A cluster task's server and sessions get it too.
  from lingvo_ext.distributed import server  # pylint: disable=g-import-not-at-top
  task = o(intra_op_threads=3, cluster_spec='worker=127.0.0.1:1',
           job='worker')
  assert server.SessionConfig(task).intra_op_parallelism_threads == 3
  assert server.SessionConfig(
      task, client=False).intra_op_parallelism_threads == 3


@pytest.mark.e2e
def testNegativeIntraOpThreadsIsAClearError(tmp_path):
  rc, out = _Run('lingvo_ext.trainer', '--model=lm.TransformerLmTiny',
                 f'--logdir={tmp_path}', '--intra_op_threads=-1')
  assert rc == 2
  assert '--intra_op_threads=-1 must be >= 0' in out
  assert 'Traceback' not in out
  assert not os.listdir(str(tmp_path))


@pytest.mark.e2e
def testAJobTheModeDoesNotRunIsAClearError(tmp_path):
  # Lingvo's cluster asserted on the pair, a traceback naming neither flag.
  rc, out = _Run('lingvo_ext.trainer', '--model=lm.TransformerLmTiny',
                 f'--logdir={tmp_path}', '--mode=sync',
                 '--job=controller,trainer')
  assert rc == 2
  assert ('error: --job=controller,trainer has job trainer, which '
          '--mode=sync does not run; its trainer job is trainer_client: pass '
          '--job=controller,trainer_client.') in out, out
  assert 'Traceback' not in out
  assert not os.listdir(str(tmp_path))


def testControllerLooksAtOnceWhenItsTrainerStops():
  # Lingvo's controller looks at the step every 10 s, so a local run ended
  # up to 10 s after its last step; it now wakes when its trainer stops.
  from lingvo_ext.runtime import runners  # pylint: disable=g-import-not-at-top
  state = runners.RunState()
  trainer = object.__new__(runners.LocalTrainer)
  trainer._run_state = state  # pylint: disable=protected-access
  controller = object.__new__(runners.LocalController)
  controller._run_state, controller._woken = state, False  # pylint: disable=protected-access
  threading.Timer(0.2, trainer._DequeueThreadComplete).start()  # pylint: disable=protected-access
  # Its next look an hour away: it returns when the trainer stops (a
  # bounded wait, however loaded the machine).
  look = threading.Thread(target=controller.WaitForNextLook,
                          args=(time.time() + 3600,), daemon=True)
  look.start()
  look.join(300)
  assert not look.is_alive()
  assert trainer.stopped and state.trainer_done.is_set()
  # Once: should the controller go on, it waits out its interval again.
  start = time.monotonic()
  controller.WaitForNextLook(time.time() + 0.5)
  assert time.monotonic() - start >= 0.45
