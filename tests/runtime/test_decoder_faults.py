"""A decoder whose graph fails to build: one `error:` line, exit 4
(runtime/local_evaler.py; docs/faults.md).

Lingvo's Decoder builds its decode graph in its constructor, outside the
loop whose failures the evaler and decoder already report in one line: a
model whose `Decode` raises printed Lingvo's traceback and exited 1.
"""

import sys

import pytest

from lingvo_ext.runtime import local_evaler
from tests.support import proc_testlib

TIMEOUT = 300
MODEL = '--model=lm.TransformerLmTiny'

# The trainer, with the LM's Decode raising while the decoder builds it.
_DECODE_FAILS = '''
import sys
from lingvo_ext.tasks.lm import model
def _Fails(self, input_batch):
  raise ValueError('no decode graph in this test')
model.TransformerLm.Decode = _Fails
from lingvo_ext import trainer
sys.argv[0] = 'lingvo_ext.trainer'
sys.exit(trainer.Run())
'''


@pytest.mark.e2e
def testADecoderWhoseGraphFailsToBuildIsOneLineAndExit4(tmp_path):
  logdir = f'--logdir={tmp_path / "log"}'
  train = [sys.executable, '-m', 'lingvo_ext.trainer', MODEL, logdir,
           '--max_steps=1']
  with proc_testlib.Proc(train) as run:
    assert run.Wait(TIMEOUT) == 0, run.Text()[-3000:]
  decode = [sys.executable, '-c', _DECODE_FAILS, MODEL, logdir,
            '--job=decoder_dev', '--eval_once']
  with proc_testlib.Proc(decode) as run:
    rc = run.Wait(TIMEOUT)
  out = run.Text()
  assert rc == local_evaler.EVAL_FAILED == 4, out[-3000:]
  assert [l for l in out.splitlines() if l.startswith('error:')] == [
      'error: decoder_dev: building its graph for the dev input failed: '
      'ValueError: no decode graph in this test; the trace is in the log '
      'file the first line names; fix the model or its params and run it '
      'again.'], out[-3000:]
  assert 'Traceback' not in out, out[-3000:]
  with open(tmp_path / 'log' / 'log.decoder_dev.txt') as f:
    assert 'Traceback' in f.read()  # The log keeps the trace.
