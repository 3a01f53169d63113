"""Preemption: SIGTERM stops every job safely, through the launcher too;
evaluating a logdir once; process titles.

Each test runs trainers or launchers in process groups of their own
(tests/support/proc_testlib.py), waits for a line of their output (never a fixed
sleep), bounds every wait and kills what it started when its `with` block
ends, passed or failed; the runs it only waits for are forked from the
tests' server (tests/support/zygote.py).
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

from tests.support import proc_testlib
from tests.support import zygote

TIMEOUT = 300
MODEL = '--model=lm.TransformerLmTiny'
# No periodic checkpoint after the first: any later one is the stop's.
NO_PERIODIC_SAVE = '--model_params_override=train.save_interval_seconds:3600'


def _Trainer(*flags, env=None, python_code=None):
  if python_code:
    argv = [sys.executable, '-c', python_code, *flags]
  else:
    argv = [sys.executable, '-m', 'lingvo_ext.trainer', *flags]
  return proc_testlib.Proc(argv, env)


def _Run(*flags):
  """(exit code, output) of a trainer run to its end (forked: zygote)."""
  proc = zygote.run([sys.executable, '-m', 'lingvo_ext.trainer', *flags],
                    cwd=proc_testlib.ROOT, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True,
                    timeout=proc_testlib.TIMEOUT)
  return proc.returncode, proc.stdout


def _Latest(logdir):
  return tf.train.latest_checkpoint(os.path.join(logdir, 'train'))


def _Step(path):
  return int(path.rsplit('-', 1)[1])


def _LastProgressStep(text):
  steps = [int(s) for s in re.findall(r'^step (\d+)/', text, re.M)]
  return max(steps) if steps else None


def _AdamSlot(names):
  return sorted(n for n in names if n.endswith('/Adam') and 'global' not in n)


@pytest.mark.e2e
def testSigtermSavesTheCurrentStepAndTheRestartResumesAfterIt(tmp_path):
  logdir = str(tmp_path / 'log')
  with _Trainer(MODEL, f'--logdir={logdir}', '--max_steps=1000000',
                NO_PERIODIC_SAVE) as run:
    run.WaitFor(r'^step (\d*[1-9]\d)/', TIMEOUT)  # Step 10 or more.
    run.proc.send_signal(signal.SIGTERM)
    rc = run.Wait()
  out = run.Text()
  assert rc == 0, out[-3000:]
  assert 'SIGTERM: stopping safely' in out, out[-3000:]
  latest = _Latest(logdir)
  step = _Step(latest)
  assert step >= _LastProgressStep(out) >= 10, out[-3000:]
  reader = tf.train.load_checkpoint(latest)
  names = reader.get_variable_to_shape_map()
  slots = _AdamSlot(names)
  assert slots, sorted(names)
  slot, var = slots[0], slots[0][:-len('/Adam')]
  saved = {n: reader.get_tensor(n) for n in (slot, var)}
  assert np.any(saved[slot] != 0)  # Adam's state of the steps trained.

  # The restart resumes at step + 1 from that state: one more step.
  rc, out = _Run(MODEL, f'--logdir={logdir}', f'--max_steps={step + 1}',
                 NO_PERIODIC_SAVE)
  assert rc == 0, out[-3000:]
  assert re.search(rf'^step {step + 1}/{step + 1} ', out, re.M), out[-3000:]
  assert not re.search(rf'^step {step}/', out, re.M), out[-3000:]
  with open(os.path.join(logdir, 'log.controller+trainer_client.txt')) as f:
    assert f'Restored {step} ' in f.read()
  after = tf.train.load_checkpoint(_Latest(logdir))
  assert _Step(_Latest(logdir)) == step + 1
  # One Adam step from the saved state: close to it, not equal.
  for n in (slot, var):
    value = after.get_tensor(n)
    assert not np.array_equal(value, saved[n]), n
    np.testing.assert_allclose(value, saved[n], atol=0.05, rtol=0.5)


# The saver commits a checkpoint (writes the `checkpoint` state file) after
# its files are whole; this stub sleeps there for every save after the
# first, so that a stop lands mid-save.
_SLOW_SAVE = '''
import sys, time
from lingvo.core import saver
_update = saver.Saver._UpdateState
def _Slow(self, prefix):
  if not prefix.endswith('ckpt-00000000'):
    print('slow save: committing ' + prefix, flush=True)
    time.sleep(600)
  return _update(self, prefix)
saver.Saver._UpdateState = _Slow
from lingvo_ext import trainer
sys.argv[0] = 'lingvo_ext.trainer'
sys.exit(trainer.Run())
'''


@pytest.mark.e2e
def testStopDuringASaveLeavesTheStateFileNamingCompleteCheckpoints(tmp_path):
  logdir = str(tmp_path / 'log')
  with _Trainer(MODEL, f'--logdir={logdir}', '--max_steps=1000000',
                NO_PERIODIC_SAVE, '--shutdown_grace_secs=3',
                python_code=_SLOW_SAVE) as run:
    run.WaitFor(r'^step (\d*[1-9]\d)/')
    run.proc.send_signal(signal.SIGTERM)
    run.WaitFor(r'slow save: committing')
    rc = run.Wait()
  out = run.Text()
  assert rc == 143, out[-3000:]
  assert ('not done within --shutdown_grace_secs=3: exiting without the '
          'final checkpoint') in out, out[-3000:]
  from lingvo_ext import checkpoints  # pylint: disable=g-import-not-at-top
  state = tf.train.get_checkpoint_state(os.path.join(logdir, 'train'))
  assert [_Step(p) for p in state.all_model_checkpoint_paths] == [0]
  for path in state.all_model_checkpoint_paths:
    assert checkpoints.CheckpointProblem(path) is None


@pytest.mark.e2e
def testSigtermBeforeAnyCheckpointSaysSoAndExits0(tmp_path):
  logdir = str(tmp_path / 'log')
  with _Trainer(MODEL, f'--logdir={logdir}', '--max_steps=10') as run:
    # Printed once the flags are read, before the model is built.
    run.WaitFor(r'^lingvo_ext.trainer: --model=')
    run.proc.send_signal(signal.SIGTERM)
    rc = run.Wait()
  out = run.Text()
  if _Latest(logdir):  # The first save won the race: stopped after it.
    assert rc == 0 and 'SIGTERM: stopping safely' in out, out[-3000:]
  else:
    assert rc == 0, out[-3000:]
    assert ('SIGTERM: no checkpoint yet (training had not started): nothing '
            'to save; exiting.') in out, out[-3000:]


def _Unfinished(tiny_gpipe_run, dst):
  """A copy of a finished run as a stopped run leaves it (not finished):
  no training_finished, its recorded max_steps beyond its last step."""
  # pylint: disable-next=g-import-not-at-top
  from lingvo_ext.runtime import training_end
  logdir = tiny_gpipe_run.Copy(dst)
  os.remove(os.path.join(logdir, 'train', 'training_finished'))
  training_end.Record(os.path.join(logdir, 'train'), 1000)
  return logdir


@pytest.mark.e2e
def testSigtermToAnEvalerAndADecoderExits0WithoutPartialFiles(
    tmp_path, tiny_gpipe_run):
  logdir = _Unfinished(tiny_gpipe_run, str(tmp_path / 'log'))
  with _Trainer(f'--model={tiny_gpipe_run.model}', *tiny_gpipe_run.flags,
                f'--logdir={logdir}', '--job=evaler_dev,decoder_dev') as run:
    # The trainer is gone: said once, not every 30 s.
    run.WaitFor(r'no trainer runs on this logdir .*: waiting for new '
                r'checkpoints \(--eval_once evaluates the newest and exits\)')
    run.WaitFor(r'decoder_dev: step 3 ')
    run.WaitFor(r'evaler_dev: step 3 ')
    run.proc.send_signal(signal.SIGTERM)
    rc = run.Wait()
  out = run.Text()
  assert rc == 0, out[-3000:]
  assert not glob.glob(os.path.join(logdir, '*', '*.tmp*')), out[-3000:]
  assert os.path.exists(
      os.path.join(logdir, 'decoder_dev', 'samples-00000003.txt'))


@pytest.mark.e2e
def testEvalOnceEvaluatesTheNewestCheckpointOfAStoppedRunAndExits(
    tmp_path, tiny_gpipe_run):
  logdir = _Unfinished(tiny_gpipe_run, str(tmp_path / 'log'))
  flags = [f'--model={tiny_gpipe_run.model}', *tiny_gpipe_run.flags,
           f'--logdir={logdir}', '--job=evaler_dev']
  for extra, step in (['--eval_once'], 3), (
      [f'--eval_checkpoint={logdir}/train/ckpt-00000000'], 0):
    rc, out = _Run(*flags, *extra)
    assert rc == 0, out[-3000:]
    assert re.search(rf'^evaler_dev: step {step}  .*log_pplx', out,
                     re.M), out[-3000:]
  empty = str(tmp_path / 'empty')
  rc, out = _Run(f'--model={tiny_gpipe_run.model}', *tiny_gpipe_run.flags,
                 f'--logdir={empty}', '--job=evaler_dev', '--eval_once')
  # No job ends 0 without its work: refused up front, nothing written.
  assert rc == 2, out[-3000:]
  assert (f'error: --eval_once: no checkpoint in {empty}/train to evaluate; '
          'train with the same --logdir first, or pass --eval_checkpoint.'
          ) in out, out[-3000:]
  assert not os.path.exists(empty), os.listdir(empty)
  rc, out = _Run(*flags, f'--eval_checkpoint={logdir}/train/ckpt-7')
  assert rc == 2, out[-3000:]
  assert (f'error: --eval_checkpoint={logdir}/train/ckpt-7: no such '
          'checkpoint') in out


@pytest.mark.e2e
def testSigtermToTheLauncherSavesOnceStopsEveryTaskAndResumes(tmp_path):
  logdir = str(tmp_path / 'log')
  flags = ['--model=lm.TransformerLmTinyGPipe', f'--logdir={logdir}',
           '--workers=2', '--worker_split_size=2', '--network=host',
           NO_PERIODIC_SAVE]
  with proc_testlib.Proc([sys.executable, '-m', 'lingvo_ext.launch', *flags,
                         '--max_steps=1000000']) as run:
    run.WaitFor(r'step (\d*[1-9]\d)/')
    pids = run.Pids()
    assert len(pids) == 4, run.Text()[-3000:]
    # Each task's title names its job and task.
    for what, pid in pids.items():
      job, task = what.split(' task ')
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        title = f.read().replace(b'\0', b' ').decode().strip()
      assert title.startswith(f'lingvo_ext {job}.{task} {logdir}'), title
    before = len(glob.glob(os.path.join(logdir, 'train', 'ckpt-*.index')))
    run.proc.send_signal(signal.SIGTERM)
    rc = run.Wait()
    out = run.Text()
    assert rc == 0, out[-5000:]
    assert 'launch: the last checkpoint was saved.' in out, out[-5000:]
    for what, pid in pids.items():
      assert not proc_testlib.Alive(pid), (what, out[-3000:])
  saved = glob.glob(os.path.join(logdir, 'train', 'ckpt-*.index'))
  assert len(saved) == before + 1, saved  # One final checkpoint.
  step = _Step(_Latest(logdir))
  assert step >= _LastProgressStep(
      '\n'.join(re.sub(r'^\[\w+\] ', '', l) for l in run.lines)), out[-3000:]

  with proc_testlib.Proc([sys.executable, '-m', 'lingvo_ext.launch', *flags,
                         f'--max_steps={step + 2}']) as rerun:
    rc = rerun.Wait()
  assert rc == 0, rerun.Text()[-5000:]
  assert _Step(_Latest(logdir)) == step + 2
  assert not re.search(rf'step {step}/', rerun.Text()), rerun.Text()[-3000:]


def testStopOnSignalsExitCodes():
  from lingvo_ext.runtime import runners  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import shutdown  # pylint: disable=g-import-not-at-top

  def Run(signals, owns=True, saved=False, nothing=None, preempted=0):
    state, codes = runners.RunState(), []
    stop = shutdown.StopOnSignals(state, 1e-3, lambda: nothing,
                                  lambda: 'ckpt-5', owns,
                                  exit_now=codes.append,
                                  preempted_code=preempted)
    if saved:
      state.final_save.set()
    for s in signals:
      stop.Handle(s)
    deadline = time.monotonic() + 10
    while (not codes and time.monotonic() < deadline and
           state.interrupted.is_set()):
      time.sleep(0.01)
    return state, codes

  term, hup, sigint = signal.SIGTERM, signal.SIGHUP, signal.SIGINT
  assert Run([term], saved=True)[1] == [0]  # Saved by the deadline.
  assert Run([term])[1] == [143]  # The deadline first.
  assert Run([hup])[1] == [143]
  assert Run([sigint])[1] == [130]
  assert Run([term], owns=False)[1] == [0]  # An evaler drops its work.
  assert Run([term, term])[1][0] == 143  # A second signal: at once.
  assert Run([term, sigint])[1][0] == 143
  state, codes = Run([term], nothing='no checkpoint yet')
  assert codes == [0] and not state.interrupted.is_set()
  # --preempted_exit_code takes 0's place after a stop that lost nothing.
  assert Run([term], saved=True, preempted=75)[1] == [75]
  assert Run([term], owns=False, preempted=75)[1] == [75]
  assert Run([term], nothing='no checkpoint yet', preempted=75)[1] == [75]
  assert Run([term], preempted=75)[1] == [143]
  assert Run([sigint], saved=True, preempted=75)[1] == [130]
  assert shutdown.ExitCode(term, True, 75) == 75
  assert shutdown.CheckPreemptedCode(75) is None
  for bad in (-1, 256, 2, 143):
    assert shutdown.CheckPreemptedCode(bad).startswith(
        f'--preempted_exit_code={bad} must be 0-255'), bad


@pytest.mark.e2e
def testACopiedLogdirTrainsAndEvaluatesFromItsOwnCheckpoints(
    tmp_path, tiny_gpipe_run):
  # A state file naming checkpoints by absolute path (another writer's, or
  # an older version's): a plain copy still names the original's files.
  original = str(tmp_path / 'run1')
  shutil.copytree(tiny_gpipe_run.logdir, original)
  state = tf.train.get_checkpoint_state(os.path.join(original, 'train'))
  tf.compat.v1.train.update_checkpoint_state(
      os.path.join(original, 'train'), state.model_checkpoint_path,
      all_model_checkpoint_paths=list(state.all_model_checkpoint_paths))
  with open(os.path.join(original, 'train', 'checkpoint')) as f:
    assert f'"{original}/train/ckpt-00000003"' in f.read()
  copy = str(tmp_path / 'run2')
  shutil.copytree(original, copy)
  shutil.rmtree(original)
  flags = [f'--model={tiny_gpipe_run.model}', *tiny_gpipe_run.flags,
           f'--logdir={copy}']
  rc, out = _Run(*flags, '--job=evaler_dev', '--eval_once')
  assert rc == 0, out[-3000:]
  assert re.search(r'^evaler_dev: step 3  ', out, re.M)
  rc, out = _Run(*flags, '--max_steps=5')
  assert rc == 0, out[-3000:]
  assert (f'{copy}/train/checkpoint named checkpoints in {original}/train (a '
          'copied or moved logdir); using this logdir\'s own files of the '
          'same names.') in out, out[-3000:]
  with open(os.path.join(copy, 'log.controller+trainer_client.txt')) as f:
    assert 'Restored 3 ' in f.read()
  assert _Latest(copy) == f'{copy}/train/ckpt-00000005'
  assert not os.path.exists(original)


def _StatePaths(train_dir):
  """The paths the state file holds as written, and as TF reads them."""
  with open(os.path.join(train_dir, 'checkpoint')) as f:
    written = re.findall(r'^\w+_paths?: "([^"]*)"$', f.read(), re.M)
  state = tf.train.get_checkpoint_state(train_dir)
  return written, [state.model_checkpoint_path,
                   *state.all_model_checkpoint_paths]


@pytest.mark.e2e
def testTheStateFileNamesCheckpointsRelativelySoACopiedLogdirNeedsNoFix(
    tmp_path, tiny_gpipe_run):
  train = os.path.join(tiny_gpipe_run.logdir, 'train')
  written, read = _StatePaths(train)
  assert written == ['ckpt-00000003', 'ckpt-00000000', 'ckpt-00000003']
  assert read == [os.path.join(train, p) for p in written]
  original = str(tmp_path / 'run1')
  shutil.copytree(tiny_gpipe_run.logdir, original)
  copy = str(tmp_path / 'run2')
  shutil.copytree(original, copy)
  shutil.rmtree(original)
  flags = [f'--model={tiny_gpipe_run.model}', *tiny_gpipe_run.flags,
           f'--logdir={copy}']
  rc, out = _Run(*flags, '--job=evaler_dev', '--eval_once')
  assert rc == 0, out[-3000:]
  assert re.search(r'^evaler_dev: step 3  ', out, re.M)
  # Resumed, saving at least at its start and end, keeping the newest 2:
  # Lingvo's saver reads the relative entries back (ckpt-00000000 and
  # ckpt-00000003 of the first run too) and deletes the older checkpoints.
  rc, more = _Run(*flags, '--max_steps=7', '--model_params_override='
                  'train.save_interval_steps:1;train.save_max_to_keep:2;'
                  'train.save_keep_checkpoint_every_n_hours:0')
  out += more
  assert rc == 0, more[-3000:]
  assert 'named checkpoints in' not in out and 'outside this logdir' not in out
  with open(os.path.join(copy, 'log.controller+trainer_client.txt')) as f:
    assert 'Restored 3 ' in f.read()
  train = os.path.join(copy, 'train')
  written, read = _StatePaths(train)
  # The newest 2 saves kept; one name when the controller's look met the
  # last step (Lingvo's saver names a checkpoint by the step it reads then).
  assert written[0] == written[-1] == 'ckpt-00000007', written
  assert len(written) in (2, 3), written
  assert read == [os.path.join(train, p) for p in written]
  assert _Latest(copy) == f'{train}/ckpt-00000007'
  assert sorted(os.path.basename(p)[:-len('.index')] for p in glob.glob(
      os.path.join(train, 'ckpt-*.index'))) == written[1:]
  assert not os.path.exists(original)


def testLocalizeStateFileUsesTheLogdirsOwnFilesOrSaysWhereTheyPoint(
    tmp_path):
  from lingvo_ext import checkpoints  # pylint: disable=g-import-not-at-top
  train = tmp_path / 'run2' / 'train'
  train.mkdir(parents=True)
  old = '/elsewhere/run1/train'
  paths = [f'{old}/ckpt-00000000', f'{old}/ckpt-00000005']
  tf.compat.v1.train.update_checkpoint_state(
      str(train), paths[-1], all_model_checkpoint_paths=paths)
  (train / 'ckpt-00000005.index').write_text('')
  note = checkpoints.LocalizeStateFile(str(train))
  assert note == (f'{train}/checkpoint names checkpoints in {old}, outside '
                  f'this logdir, and ckpt-00000000 is not in {train}; using '
                  'the paths as written.')
  assert checkpoints.LatestCheckpoint(str(train)) == f'{train}/ckpt-00000005'
  (train / 'ckpt-00000000.index').write_text('')
  note = checkpoints.LocalizeStateFile(str(train))
  assert note.startswith(f'{train}/checkpoint named checkpoints in {old} ')
  state = tf.train.get_checkpoint_state(str(train))
  assert list(state.all_model_checkpoint_paths) == [
      f'{train}/ckpt-00000000', f'{train}/ckpt-00000005']
  assert _StatePaths(str(train))[0] == [
      'ckpt-00000005', 'ckpt-00000000', 'ckpt-00000005']
  assert checkpoints.LocalizeStateFile(str(train)) is None
