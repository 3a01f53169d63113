"""bench/serving.py: the SavedModel against the training forward pass."""

import json
import os
import subprocess
import sys

import pytest

from tests.support import zygote
from tests.support import ROOT as _REPO


def testBadArgsAreArgparseErrors():
  from bench import serving  # pylint: disable=g-import-not-at-top
  assert serving.ParseArgs(['--batches', '1,4']).batches == [1, 4]
  for argv in (['--batches', 'x'], ['--batches', '0'], ['--runs', '0']):
    with pytest.raises(SystemExit):
      serving.ParseArgs(argv)


@pytest.mark.e2e
def testServingBenchRowsAndNoPipelineOpsInTheExport():
  out = zygote.run(
      [sys.executable, '-m', 'bench.serving', '--batches', '1,4', '--runs',
       '2', '--warmup', '1'],
      capture_output=True, text=True, timeout=600, cwd=_REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(l) for l in out.stdout.splitlines() if l.strip()]
  assert [r['batch'] for r in rows] == [1, 4]
  # The 2-micro-batch pipeline takes 2 examples at least.
  assert [r['training_forward_batch'] for r in rows] == [2, 4]
  for r in rows:
    assert r['saved_model_ms'] > 0 and r['training_forward_ms'] > 0, r
    assert r['exported_pipeline_ops'] == 0, r
    assert r['training_pipeline_ops'] > 0, r  # The count can find them.
