"""Lingvo's GPipe NMT experiment (tests/support/mt_testlib.py) in the jobs.

conftest.py's lingvo_mt_run trains it once (2 cells on 2 CPU devices, 3
steps); the evaler evaluates that checkpoint once; `--plan=auto` plans and
trains it.
"""

import re
import subprocess
import sys

import numpy as np
import pytest

from tests.support import ROOT
from tests.support import mt_testlib
from tests.support import zygote

TIMEOUT = 600


def _Run(pythonpath, args):
  proc = zygote.run([sys.executable, '-m', 'lingvo_ext.trainer', *args],
                    cwd=ROOT, env=mt_testlib.Env(pythonpath),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, timeout=TIMEOUT, check=False)
  return proc.returncode, proc.stdout


def _Losses(out):
  return [float(x) for x in re.findall(r'^step \d+/\d+\s+loss (\S+)', out,
                                       re.M)]


@pytest.mark.e2e
def testTheTrainedRunAndTheEvalersOnePass(lingvo_mt_run, tmp_path):
  out = lingvo_mt_run.output
  assert 'step 3/3' in out and not re.search(r'^error:', out, re.M), out[-3000:]
  losses = _Losses(out)
  assert losses and np.all(np.isfinite(losses)), out[-3000:]
  logdir = lingvo_mt_run.Copy(str(tmp_path / 'logdir'))
  rc, out = _Run(lingvo_mt_run.pythonpath, [
      f'--model={lingvo_mt_run.model}', f'--logdir={logdir}',
      *lingvo_mt_run.flags, '--job=evaler_dev', '--eval_once'])
  assert rc == 0, out[-3000:]
  [line] = [l for l in out.splitlines() if l.startswith('evaler_dev: step 3 ')]
  fields = line.split()[3:]
  metrics = {k: float(v) for k, v in zip(fields[::2], fields[1::2])}
  assert metrics['total_samples'] == mt_testlib.DEV_EXAMPLES
  # Near a uniform model's log(VOCAB_SIZE) = 3.87 after 3 small steps.
  assert 3.0 < metrics['log_pplx'] < 4.5, line
  assert metrics['loss'] == metrics['log_pplx']


@pytest.mark.e2e
def testPlanAutoPlansAndTrainsTheMtStack(lingvo_mt_run, tmp_path):
  logdir = tmp_path / 'logdir'
  rc, out = _Run(lingvo_mt_run.pythonpath, [
      f'--model={mt_testlib.MODEL}', f'--logdir={logdir}', '--max_steps=2',
      '--plan=auto', '--devices=2'])
  assert rc == 0, out[-3000:]
  [line] = [l for l in out.splitlines() if l.startswith('--plan=auto chose')]
  assert line.startswith('--plan=auto chose task.stack K2xR1 M'), line
  losses = _Losses(out)
  assert len(losses) == 2 and np.all(np.isfinite(losses)), out[-3000:]
  override = re.search(r"--model_params_override='([^']*)'", line).group(1)
  with open(logdir / 'control' / 'params.txt') as f:
    params = f.read()
  for item in override.split(';'):
    key, value = item.strip().split(':', 1)
    # Lingvo's params text writes None as its type's name.
    value = 'NoneType' if value == 'None' else value.replace('"', "'")
    assert re.search(r'^%s : %s$' % (re.escape(key), re.escape(value)),
                     params, re.M), (item, line)


@pytest.mark.e2e
@pytest.mark.parametrize('override,expected', [
    ('input.bucket_upper_bound:[2];input.bucket_batch_limit:[8]',
     'error: the Train input (input): input.bucket_upper_bound=[2]: none of '
     'the 600 examples sampled from input.file_pattern fits'),
    ('input.bucket_upper_bound:[6, 8, 12];input.bucket_batch_limit:[8, 8, 8]',
     'error: the Train input (input): input.bucket_upper_bound ends at 12, '
     'above input.source_max_length=10'),
], ids=['nothing_fits', 'bound_beyond_max_length'])
def testLengthsAgainstTheBucketsAreOneLineBeforeAnythingIsWritten(
    lingvo_mt_run, tmp_path, override, expected):
  # Before: the trainer hung with nothing printed, or retried the failing
  # batches silently and exited 0.
  logdir = tmp_path / 'logdir'
  rc, out = _Run(lingvo_mt_run.pythonpath, [
      f'--model={mt_testlib.MODEL}', f'--logdir={logdir}', '--max_steps=1',
      *lingvo_mt_run.flags, f'--model_params_override={override}'])
  errors = [l for l in out.splitlines() if l.startswith('error:')]
  assert rc == 2 and len(errors) == 1, out[-3000:]
  assert errors[0].startswith(expected), errors
  assert not logdir.exists()
