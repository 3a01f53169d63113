"""bench/transformer.py: Lingvo's GPipeTransformerStack through both libraries."""

import os
import subprocess
import sys

import pytest

from bench import transformer
from tests import zygote

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pairs_and_markdown():
  assert transformer.Pairs([2, 4], [4, 16]) == [(2, 4), (4, 16)]
  assert transformer.Pairs([2], [4, 8]) == [(2, 4), (2, 8)]
  base = dict(L=8, K=2, M=4, ops=100, first_step_s=1., step_ms=80.,
              cpu_ms=150., peak_rss_mb=500)
  text = transformer.Markdown([
      dict(base, variant='lingvo'),
      dict(base, variant='unrolled+functions', step_ms=40.),
      dict(variant='1f1b', L=8, K=2, M=4, error='timeout 1800s'),
      dict(base, variant='unrolled', loss='last_cell', step_ms=40.,
           ops_run=900),
      dict(base, variant='1f1b', loss='last_cell', step_ms=46., ops_run=910)])
  lines = text.splitlines()
  assert lines[3] == ('| 8, 2, 4 | unrolled+functions | 100 | 1.0 | 40.0 | '
                      '150 | 500 | - | 0.50x |  |')
  assert 'timeout 1800s' in lines[4]
  # Each schedule against the default's row with the same loss placement.
  assert lines[6] == ('| 8, 2, 4 | 1f1b, loss in last cell | 100 | 1.0 | '
                      '46.0 | 150 | 500 | 910 | 0.57x | 1.15x |')


def test_bad_variant_is_one_line_exit_2():
  res = subprocess.run(
      [sys.executable, os.path.join(_REPO, 'bench', 'transformer.py'),
       '--variants', 'gpipe'], capture_output=True, text=True, timeout=120,
      check=False)
  assert res.returncode == 2
  assert "--variants: 'gpipe' is not" in res.stderr
  res = subprocess.run(
      [sys.executable, os.path.join(_REPO, 'bench', 'transformer.py'),
       '--intra_op_threads', '-1'], capture_output=True, text=True,
      timeout=120, check=False)
  assert res.returncode == 2
  assert '--intra_op_threads=-1: give 0' in res.stderr


def _Forked(cmd, **kwargs):
  """transformer.Run's children (`python bench/transformer.py --_child ...`)
  as `python -m bench.transformer ...` forked from the tests' pre-imported
  server: still one fresh process per variant, without ~5 s of imports each."""
  assert cmd[1] == os.path.join(_REPO, 'bench', 'transformer.py'), cmd
  return zygote.run([cmd[0], '-m', 'bench.transformer'] + cmd[2:], cwd=_REPO,
                    **kwargs)


@pytest.mark.e2e
def test_same_first_loss_in_both_libraries():
  # Same Params and seed: the first step's loss is the same in Lingvo's
  # pipeline and in lingvo_ext's, with cells inline, built once, or compiled
  # with XLA (a cell reading the global step and asserting shapes).
  records = transformer.Run(['lingvo', 'unrolled+inline', 'unrolled',
                             'unrolled+jit'],
                            [2], [(2, 2)], steps=1, timeout_s=600,
                            runner=_Forked, intra_op_threads=2)
  assert all('error' not in r for r in records), records
  assert {r['intra_op_threads'] for r in records} == {2}
  losses = [r['loss0'] for r in records]
  assert losses[0] == pytest.approx(losses[1], rel=1e-5)
  assert losses[0] == pytest.approx(losses[2], rel=1e-5)
  assert losses[0] == pytest.approx(losses[3], rel=1e-4)  # XLA's kernels.
  ops = {r['variant']: r['ops'] for r in records}
  assert ops['unrolled'] < ops['unrolled+inline']
  # The traced step's op time leaves the call ops' spans out (their body ops
  # are counted): with cells built once it is less than the sum with them.
  run = {r['variant']: r for r in records}
  assert all(0 < r['op_ms'] <= r['busy_ms'] and r['ops_run'] > 0
             for r in records), records
  assert all(r['cpu_ms'] > 0 for r in records), records
  assert run['unrolled']['op_ms'] < run['unrolled']['busy_ms']


@pytest.mark.e2e
def test_loss_in_last_cell_same_loss_no_recompute():
  # --loss after last_cell: the same first loss; with the loss in the last
  # cell '1f1b' calls each cell's forward function once per micro-batch
  # (no recompute), with it after the pipeline twice.
  records = transformer.Run(['1f1b'], [2], [(2, 2)], steps=1, timeout_s=600,
                            runner=_Forked, losses=('after', 'last_cell'))
  assert all('error' not in r for r in records), records
  after, last = records
  assert (after['loss'], last['loss']) == ('after', 'last_cell')
  assert last['loss0'] == pytest.approx(after['loss0'], rel=1e-5)
  assert last['call_ops'] < after['call_ops']
  assert last['ops_run'] < after['ops_run']
