"""Lingvo's flagship LM experiment (scaled down) in every job.

The experiment is tests/flagship_testlib.py's copy of Lingvo's
`OneBWdsGPipeTransformer` with its bucket tables, batch-major and
time-major, on its dataset layout rebuilt from Python's own text.
"""

import os
import subprocess
import sys

import pytest

from tests import flagship_testlib
from tests import zygote

from lingvo_ext import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300


@pytest.fixture(scope='module')
def flagship(tmp_path_factory):
  """The experiment's directory (for PYTHONPATH), registered in-process."""
  root = tmp_path_factory.mktemp('flagship')
  flagship_testlib.Write(root)
  flagship_testlib.Register(root)
  yield root
  sys.path.remove(str(root))


def _Run(root, args, **env):
  proc = zygote.run([sys.executable, '-m', 'lingvo_ext.trainer', *args],
                    cwd=ROOT, env=flagship_testlib.Env(root, **env),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, timeout=TIMEOUT, check=False)
  return proc.returncode, proc.stdout


def _Errors(out):
  return [line for line in out.splitlines() if line.startswith('error:')]


def testTheCopyKeepsLingvosTablesScaledDown(flagship):
  del flagship
  train = registry.GetParams(flagship_testlib.MODEL, 'Train')
  dev = registry.GetParams(flagship_testlib.MODEL, 'Dev')
  test = registry.GetParams(flagship_testlib.MODEL, 'Test')
  assert train.input.bucket_batch_limit == [4]
  assert train.input.fixed_input_shape
  assert dev.input.bucket_upper_bound == list(
      flagship_testlib.LINGVO_DEV_BOUNDS)
  assert dev.input.bucket_batch_limit == [8, 4, 2, 2, 1, 1, 1, 1, 1]
  assert dev.input.name == '1bwds_dev_set'
  assert test.input.name == '1bwds_test_set'
  assert 'heldout-00000' in test.input.file_pattern
  assert dev.task.eval.samples_per_summary == 0
  assert dev.task.cls.__name__ == 'BatchMajorLanguageModel'
  time_major = registry.GetParams(flagship_testlib.TIME_MAJOR_MODEL, 'Train')
  assert time_major.task.cls.__name__ == 'FixedShapeInputLanguageModel'
  with open(train.input.tokenizer.token_vocab_filepath) as f:
    assert len(f.read().splitlines()) == flagship_testlib.VOCAB_SIZE
