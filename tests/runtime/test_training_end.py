"""Evaluators follow training to its end, as the trainer defines it
(runtime/training_end.py): its recorded max_steps, its training_finished."""

import os
import re
import sys

import lingvo.compat as tf
import pytest

from lingvo_ext import checkpoints
from lingvo_ext.runtime import training_end
from tests.support import proc_testlib

TIMEOUT = 300
MODEL = '--model=lm.TransformerLmTiny'  # Its train.max_steps: 30.


def testTheRecordIsWrittenAtomicallyAndRewrittenWithAnotherValue(tmp_path):
  train_dir = str(tmp_path / 'train')
  assert training_end.Recorded(train_dir) is None
  training_end.Record(train_dir, 2500)
  assert training_end.Recorded(train_dir) == 2500
  training_end.Record(train_dir, 3000)  # A resume with another --max_steps.
  assert training_end.Recorded(train_dir) == 3000
  assert sorted(os.listdir(train_dir)) == [training_end.MAX_STEPS_FILE]


def testTheEndIsTheJobsFlagElseTheTrainersElseTheExperiments(tmp_path,
                                                             capsys):
  train_dir = str(tmp_path)
  path = os.path.join(train_dir, training_end.MAX_STEPS_FILE)
  end = training_end.End('evaler_dev', train_dir, None, 30)
  assert end.Step() == 30
  assert end.Step() == 30  # Said once.
  assert capsys.readouterr().err.splitlines() == [
      f'evaler_dev: no trainer has recorded its max_steps in {path}: '
      'evaluating each new checkpoint until the one of step 30 (the '
      "experiment's train.max_steps; --max_steps sets it), or "
      'training_finished.']
  training_end.Record(train_dir, 2500)  # The trainer starts.
  assert end.Step() == 2500
  assert capsys.readouterr().err.splitlines() == [
      'evaler_dev: following the trainer: it stops after the checkpoint of '
      f"step 2500, the trainer's max_steps (in {path}), or at "
      'training_finished.']
  assert end.Says() == ("it stops after the checkpoint of step 2500, the "
                        "trainer's max_steps")
  assert training_end.End('decoder_dev', train_dir, 40, 30).Step() == 40
  quiet = training_end.End('evaler_dev', train_dir, None, 30, quiet=True)
  assert quiet.Step() == 2500
  assert not capsys.readouterr().err


@pytest.mark.e2e
def testAnEvalerBesideATrainerEvaluatesItsFinalCheckpointThenExits(tmp_path):
  # The trainer goes past the experiment's 30 steps; the evaler, started
  # beside it without --max_steps, follows it to its last checkpoint.
  logdir = str(tmp_path / 'log')
  final = 150
  trainer = [sys.executable, '-m', 'lingvo_ext.trainer', MODEL,
             f'--logdir={logdir}', f'--max_steps={final}',
             '--model_params_override=train.save_interval_seconds:1']
  evaler = [sys.executable, '-m', 'lingvo_ext.trainer', MODEL,
            f'--logdir={logdir}', '--job=evaler_dev']
  with proc_testlib.Proc(trainer) as train, proc_testlib.Proc(evaler) as ev:
    train.WaitFor(r'^step \d+/', TIMEOUT)
    rc = ev.Wait(TIMEOUT * 2)
    ev_out = ev.Text()
    assert rc == 0, ev_out[-3000:]
    assert train.Wait(TIMEOUT) == 0, train.Text()[-3000:]
  steps = [int(s) for s in re.findall(r'^evaler_dev: step (\d+)  .*log_pplx',
                                      ev_out, re.M)]
  assert steps and steps[-1] == final, ev_out[-3000:]
  latest = tf.train.latest_checkpoint(os.path.join(logdir, 'train'))
  assert checkpoints.CheckpointStep(latest) == final
  assert ('evaler_dev: following the trainer: it stops after the checkpoint '
          f'of step {final}, the trainer\'s max_steps') in ev_out, ev_out
  assert not [l for l in ev_out.splitlines() if l.startswith('error:')]
