"""A damaged newest checkpoint, read by every job that reads checkpoints.

Each job takes the newest intact checkpoint (checkpoints.reader), names the
damaged one with the trainer's line and never blames the input: evaler and
decoder with --eval_once, --eval_checkpoint, lingvo-ext-export and
tools.convert_checkpoint (the trainer's own case is in test_trainer_safety.py).
"""

import glob
import os
import re
import subprocess
import sys

import lingvo.compat as tf
import pytest

from tests.support import ROOT
from tests.support import zygote

TIMEOUT = 300


def _Run(*args):
  proc = zygote.run([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
                    check=False)
  return proc.returncode, proc.stdout


@pytest.fixture(name='damaged')
def _Damaged(tmp_path, tiny_gpipe_run):
  """A copy of the 3-step run (checkpoints 0 and 3), ckpt-3's data cut in
  half: (logdir, the damaged checkpoint, the intact one before it)."""
  logdir = tiny_gpipe_run.Copy(str(tmp_path / 'log'))
  train_dir = os.path.join(logdir, 'train')
  bad, good = (os.path.join(train_dir, f'ckpt-{n:08d}') for n in (3, 0))
  data = max(glob.glob(bad + '.data-*'), key=os.path.getsize)
  with open(data, 'r+b') as f:
    f.truncate(os.path.getsize(data) // 2)
  return logdir, bad, good


def _SkippedLine(out, bad, good):
  lines = [l for l in out.splitlines()
           if l.startswith('warning: skipped damaged checkpoint')]
  assert len(lines) == 1, out[-3000:]
  assert re.fullmatch(
      rf'warning: skipped damaged checkpoint {re.escape(bad)} \(unreadable: '
      rf'\w+Error: .+\); using {re.escape(good)}\.', lines[0]), lines


def _Model(run):
  return [f'--model={run.model}', *run.flags]


@pytest.mark.e2e
@pytest.mark.parametrize('job', ['evaler_dev', 'decoder_dev'])
def testEvalOnceUsesTheIntactOneBeforeADamagedNewest(damaged, tiny_gpipe_run,
                                                      job):
  logdir, bad, good = damaged
  rc, out = _Run('-m', 'lingvo_ext.trainer', *_Model(tiny_gpipe_run),
                 f'--logdir={logdir}', f'--job={job}', '--eval_once')
  assert rc == 0, out[-3000:]
  _SkippedLine(out, bad, good)
  assert 'failed' not in out and 'error:' not in out, out[-3000:]
  if job == 'evaler_dev':
    assert re.search(r'^evaler_dev: step 0  .*log_pplx', out, re.M), out[-3000:]
  else:
    assert os.path.exists(
        os.path.join(logdir, 'decoder_dev', 'samples-00000000.txt'))


@pytest.mark.e2e
def testADamagedEvalCheckpointIsRefusedAsSuch(damaged, tiny_gpipe_run):
  logdir, bad, _ = damaged
  rc, out = _Run('-m', 'lingvo_ext.trainer', *_Model(tiny_gpipe_run),
                 f'--logdir={logdir}', '--job=evaler_dev',
                 f'--eval_checkpoint={bad}')
  assert rc == 2, out[-3000:]
  errors = [l for l in out.splitlines() if l.startswith('error:')]
  assert len(errors) == 1, out[-3000:]
  assert errors[0].startswith(
      f'error: --eval_checkpoint={bad} is a damaged checkpoint (unreadable: '
  ), errors
  assert errors[0].endswith('); pass an intact one, or --eval_once for the '
                            'newest intact one.'), errors
  assert 'input' not in errors[0]


@pytest.mark.e2e
def testExportUsesTheIntactOneBeforeADamagedNewest(damaged, tiny_gpipe_run,
                                                    tmp_path):
  logdir, bad, good = damaged
  export_dir = str(tmp_path / 'export')
  rc, out = _Run('-m', 'lingvo_ext.tools.export', *_Model(tiny_gpipe_run)[:1],
                 f'--logdir={logdir}', f'--export_dir={export_dir}')
  assert rc == 0, out[-3000:]
  _SkippedLine(out, bad, good)
  assert f'exported {good} to {export_dir}' in out, out[-3000:]


@pytest.mark.e2e
def testConvertCheckpointReadsADirectorysNewestIntactOne(damaged,
                                                          tiny_gpipe_run,
                                                          tmp_path):
  logdir, bad, good = damaged
  to = str(tmp_path / 'to' / 'ckpt-00000000')
  convert = ['-m', 'lingvo_ext.tools.convert_checkpoint',
             f'--from_model={tiny_gpipe_run.model}', f'--to_checkpoint={to}']
  rc, out = _Run(*convert, f'--from_checkpoint={logdir}/train')
  assert rc == 0, out[-3000:]
  _SkippedLine(out, bad, good)
  assert f'to {to}' in out, out[-3000:]
  assert int(tf.train.load_variable(to, 'global_step')) == 0
  rc, out = _Run(*convert, f'--from_checkpoint={bad}')
  assert rc == 2, out[-3000:]
  assert (f'error: --from_checkpoint={bad} is a damaged checkpoint '
          '(unreadable: ') in out, out[-3000:]
