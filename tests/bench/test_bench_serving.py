"""bench/serving.py: the SavedModel against the training forward pass, and
generate cached against re-run (the rows' structure and ids; no time)."""

import json
import sys

import pytest

from tests.support import ROOT as _REPO
from tests.support import zygote


def testBadArgsAreArgparseErrors():
  from bench import serving  # pylint: disable=g-import-not-at-top
  assert serving.ParseArgs(['--batches', '1,4']).batches == [1, 4]
  args = serving.ParseArgs([])
  assert (args.gen_batches, args.max_lens) == ([1, 16], [16, 32, 64])
  assert serving.ParseArgs(['--gen_batches', '']).gen_batches == []
  for argv in (['--batches', 'x'], ['--batches', '0'], ['--runs', '0'],
               ['--batches', ''], ['--max_lens', '4'], ['--prefix_len', '0'],
               ['--gen_batches', '1,0'], ['--max_seq_len', '-1']):
    with pytest.raises(SystemExit):
      serving.ParseArgs(argv)


@pytest.mark.e2e
def testServingBenchRowsAndNoPipelineOpsInTheExport():
  out = zygote.run(
      [sys.executable, '-m', 'bench.serving', '--batches', '1,4', '--runs',
       '2', '--warmup', '1', '--gen_batches', '2', '--max_lens', '6,40'],
      capture_output=True, text=True, timeout=600, cwd=_REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [json.loads(l) for l in out.stdout.splitlines() if l.strip()]
  rows = [r for r in lines if r['kind'] == 'score']
  assert [r['batch'] for r in rows] == [1, 4]
  gen = [r for r in lines if r['kind'] == 'generate']
  assert [(r['batch'], r['max_len']) for r in gen] == [(2, 6), (2, 40)]
  for r in gen:
    # All variants ran, to max_len (past seq_len with max_seq_len 64), and
    # gave the same greedy ids.
    assert r['same_ids'] is True, r
    assert r['ids_shape'] == [2, r['max_len']], r
    assert r['new_tokens'] == 2 * (r['max_len'] - 4), r
    assert r['max_seq_len'] == 64, r
    for key in ('cached_ms', 'cached_ops_ms', 'rerun_ms', 'score_window_ms',
                'cached_cpu_ms', 'score_window_cpu_ms'):
      assert r[key] > 0, r
  # The 2-micro-batch pipeline takes 2 examples at least.
  assert [r['training_forward_batch'] for r in rows] == [2, 4]
  for r in rows:
    assert r['saved_model_ms'] > 0 and r['training_forward_ms'] > 0, r
    assert r['exported_pipeline_ops'] == 0, r
    assert r['training_pipeline_ops'] > 0, r  # The count can find them.


@pytest.mark.e2e
def testAMaxLenPastThePositionEmbeddingIsOneErrorLine():
  out = zygote.run(
      [sys.executable, '-m', 'bench.serving', '--max_seq_len', '0',
       '--max_lens', '16,64'],
      capture_output=True, text=True, timeout=600, cwd=_REPO)
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == (
      "error: --max_lens=64 exceeds the models' position embedding (32 "
      'rows); raise --max_seq_len.')
