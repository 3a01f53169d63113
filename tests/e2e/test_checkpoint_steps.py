"""Every checkpoint `ckpt-N` of a run stores global_step N.

The controller saves while the trainer steps; the checkpoints of a local run
and of a launcher run, saving every second, are read back one by one.
"""

import glob
import os
import sys

import lingvo.compat as tf
import pytest

from tests.support import proc_testlib

TIMEOUT = 300
_SAVE_OFTEN = ('--model_params_override=train.save_interval_seconds:1;'
               'train.save_max_to_keep:1000')


def _StepsByName(train_dir):
  """{N of ckpt-N: the global_step it stores} of every checkpoint on disk."""
  found = {}
  for index in glob.glob(os.path.join(train_dir, 'ckpt-*.index')):
    prefix = index[:-len('.index')]
    found[int(prefix.rsplit('-', 1)[1])] = int(
        tf.train.load_variable(prefix, 'global_step'))
  return found


def _Check(run, train_dir):
  rc = run.Wait(TIMEOUT)
  assert rc == 0, run.Text()[-3000:]
  found = _StepsByName(train_dir)
  # Saves every second beside a trainer that steps meanwhile.
  assert len(found) >= 3, (found, run.Text()[-3000:])
  wrong = {n: s for n, s in found.items() if n != s}
  assert not wrong, f'ckpt-N: the step it stores: {wrong} (of {found})'


@pytest.mark.e2e
@pytest.mark.parametrize('model,flags', [
    ('lm.TransformerLmTiny', []),
    # Pipelined: 2 cells on 2 CPU devices under a schedule of its own.
    ('lm.TransformerLmTinyGPipe', ['--num_cpu_devices=2',
                                   '--worker_split_size=2']),
])
def testEveryCheckpointOfALocalRunStoresTheStepItIsNamedBy(tmp_path, model,
                                                            flags):
  logdir = str(tmp_path / 'log')
  override = _SAVE_OFTEN + (';task.schedule:"zero_bubble"' if flags else '')
  argv = [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={model}',
          f'--logdir={logdir}', '--max_steps=300', *flags, override]
  with proc_testlib.Proc(argv) as run:
    _Check(run, os.path.join(logdir, 'train'))


@pytest.mark.e2e
def testEveryCheckpointOfALauncherRunStoresTheStepItIsNamedBy(tmp_path):
  logdir = str(tmp_path / 'log')
  argv = [sys.executable, '-m', 'lingvo_ext.launch',
          '--model=lm.TransformerLmTiny', f'--logdir={logdir}', '--workers=1',
          '--max_steps=600', _SAVE_OFTEN]
  with proc_testlib.Proc(argv) as run:
    _Check(run, os.path.join(logdir, 'train'))
