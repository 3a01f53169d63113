"""The README's GPipe example: 3 cells on 2 logical CPUs match sequential."""

import sys

import pytest

from lingvo_ext.examples import gpipe_example
from tests.support import zygote


def test_example_matches_sequential():
  r = gpipe_example.Run(num_cells=3, num_devices=2, num_micro_batches=4)
  assert len(r['cell_flops']) == 3 and min(r['cell_flops']) > 0
  assert sum(r['layers_per_cell']) == len(gpipe_example.WIDTHS) - 1
  assert r['max_abs_output_diff'] < 1e-5
  assert r['max_abs_grad_diff'] < 1e-5


@pytest.mark.e2e
def test_example_prints_cells_and_difference():
  out = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.examples.gpipe_example'],
      capture_output=True, text=True, check=True).stdout
  assert out.count('FLOPs') == 3
  assert 'max |pipeline - sequential| output:' in out
