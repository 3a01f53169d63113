"""bench/weight_grad_concat.py runs, its ways give the same sums."""

import math

import pytest

from bench import weight_grad_concat


def test_every_variant_runs_and_sums_the_same():
  records = weight_grad_concat.Measure(d_model=16, hidden=32, rows=8,
                                       num_micro=3, steps=2)
  assert [r['variant'] for r in records] == list(weight_grad_concat.VARIANTS)
  assert all(0 < r['ms'] < math.inf for r in records), records
  assert records[0]['vs_concat'] == 1.0
  assert all(r['max_rel_diff'] < 1e-5 for r in records), records
  # 2 layers of 3 d^2 + 2 d hidden weights, 2 FLOPs per multiply-add.
  assert records[0]['gflop'] == pytest.approx(
      2 * 8 * 3 * 2 * (3 * 16 * 16 + 2 * 16 * 32) / 1e9, rel=1e-3)
  table = weight_grad_concat.Markdown(records).splitlines()
  assert len(table) == 2 + len(records) and '| assign_add |' in table[-1]
  with pytest.raises(SystemExit):
    weight_grad_concat.main(['--M', '0'])


def test_bias_variants_run_and_sum_the_same():
  records = weight_grad_concat.Measure(d_model=16, hidden=32, rows=8,
                                       num_micro=3, steps=2, bias=True)
  assert [r['variant'] for r in records] == list(
      weight_grad_concat.BIAS_VARIANTS)
  assert all(r['max_rel_diff'] < 1e-5 for r in records), records
  assert records[0]['gflop'] == pytest.approx(
      2 * 8 * 3 * 2 * (3 * 17 * 16 + 17 * 32 + 33 * 16) / 1e9, rel=1e-3)
