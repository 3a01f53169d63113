"""bench/transformer.py: Lingvo's GPipeTransformerStack through both libraries."""

import os
import subprocess
import sys

import pytest

from bench import transformer
from bench import transformer_report  # pylint: disable=g-import-not-at-top
from tests.support import ROOT as _REPO
from tests.support import zygote


def test_pairs_and_markdown():
  assert transformer.Pairs([2, 4], [4, 16]) == [(2, 4), (4, 16)]
  assert transformer.Pairs([2], [4, 8]) == [(2, 4), (2, 8)]
  base = dict(L=8, K=2, M=4, ops=100, first_step_s=1., step_ms=80.,
              cpu_ms=150., peak_rss_mb=500)
  text = transformer_report.Markdown([
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


@pytest.mark.e2e
def test_a_real_width_trains_its_timed_steps_without_diverging():
  # The loss is summed over 1024 tokens: at d_model 512 a step size that
  # does not shrink with the width reached NaN (Lingvo's CheckNumerics
  # error) by the fourteenth step of a 2-layer stack.
  dims = dict(d_model=512, hidden=2048, seq=64, batch=16, heads=8)
  records = transformer.Run(['unrolled'], [2], [(2, 2)], steps=12,
                            timeout_s=600, runner=_Forked,
                            dims_list=(dims,))
  assert all('error' not in r for r in records), records
  assert records[0]['d_model'] == 512 and records[0]['step_ms'] > 0


def _SmallStep(dtype='float32'):
  """A small stack's training step, cells inline: (graph, train op)."""
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  py_utils.SetEagerMode(False)
  dims = dict(d_model=8, hidden=12, seq=4, batch=4, heads=2)
  g, _, train, _ = transformer._Build(  # pylint: disable=protected-access
      'unrolled+inline', 2, 2, 2, dtype, 'after', dims)
  return g, train


def test_graph_matmul_flops_equal_the_formula():
  from bench import gemm_floor  # pylint: disable=g-import-not-at-top
  _, train = _SmallStep()
  shapes = gemm_floor.MatmulShapes([train])
  # L=2, d 8, hidden 12, T 4, B 4, vocab 32: forward 2 x 16 tokens x
  # (2 x (3 x 64 + 2 x 96 + 2 x 4 x 8) + 8 x 32), backward twice that.
  # Lingvo's custom-gradient functions (py_utils.Function) count too.
  assert transformer.StepMatmulFlops(2, 8, 12, 4, 4) == 3 * 2 * 16 * (
      2 * (192 + 192 + 64) + 256) == 110592
  assert gemm_floor.TotalFlops(shapes) == 110592
  # Per micro-batch (2 of 2 examples each): attention's logits are
  # [batch x heads, T, d/heads] x its transpose, 4 of them a step forward.
  key = gemm_floor.Key('BatchMatMulV2', (2, 2, 4, 4), (2, 2, 4, 4), False,
                       True, 'float32')
  assert gemm_floor.Flops(key) == 2 * 4 * 4 * 4 * 4
  assert {k.dtype for k in shapes} == {'float32'}
  # A [T, b, d] activation by a [d, n] weight is timed as one GEMM.
  fc = gemm_floor.Key('BatchMatMulV2', (64, 4, 512), (2048, 512), False,
                      True, 'float32')
  assert gemm_floor.Timed(fc) == gemm_floor.Key(
      'MatMul', (256, 512), (512, 2048), False, False, 'float32')
  assert gemm_floor.Flops(gemm_floor.Timed(fc)) == gemm_floor.Flops(fc)
  assert gemm_floor.Timed(key) == key  # Attention: batched as it runs.


def test_bf16_step_matmuls_are_bf16_with_the_same_flops():
  from bench import gemm_floor  # pylint: disable=g-import-not-at-top
  _, train = _SmallStep('bfloat16')
  shapes = gemm_floor.MatmulShapes([train])
  assert gemm_floor.TotalFlops(shapes) == transformer.StepMatmulFlops(
      2, 8, 12, 4, 4)
  by_dtype = {}
  for k, n in shapes.items():
    by_dtype[k.dtype] = by_dtype.get(k.dtype, 0) + gemm_floor.Flops(k) * n
  # The cells' matmuls (all but the softmax after the pipeline) are bf16.
  assert by_dtype['bfloat16'] >= 0.8 * sum(by_dtype.values()), by_dtype


def test_floor_times_each_shape_and_only_reachable_matmuls():
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  from bench import gemm_floor  # pylint: disable=g-import-not-at-top
  g = tf.Graph()
  with g.as_default():
    a, b = tf.ones([8, 16]), tf.ones([16, 4])
    used = tf.matmul(a, b)
    tf.matmul(b, a, transpose_a=True, transpose_b=True)  # Not fetched.
  shapes = gemm_floor.MatmulShapes([used])
  assert shapes == {gemm_floor.Key('MatMul', (8, 16), (16, 4), False, False,
                                   'float32'): 1}
  floor = gemm_floor.Floor(shapes, tf.config_pb2.ConfigProto(
      inter_op_parallelism_threads=1, intra_op_parallelism_threads=1),
                           min_seconds=0.01)
  assert floor['matmul_flops'] == 2 * 8 * 16 * 4
  assert floor['floor_ms'] > 0 and floor['peak_gflops'] > 0
  assert [s['count'] for s in floor['by_shape']] == [1]
  # The timed copies' outputs feed only a group: with Grappler on they would
  # be pruned, never run.
  config = tf.config_pb2.ConfigProto(intra_op_parallelism_threads=1)
  timing = gemm_floor.TimingConfig(config)
  assert timing.graph_options.rewrite_options.disable_meta_optimizer
  assert timing.intra_op_parallelism_threads == 1
  assert not config.graph_options.rewrite_options.disable_meta_optimizer


def test_ladder_markdown_has_the_floor_columns():
  sizes = dict(d_model=512, hidden=2048, seq=64, batch=16, heads=8)
  base = dict(L=4, K=2, M=4, loss='after', **sizes)
  torch = dict(L=4, K=2, M=4, model_dim=512, hidden=2048, time_steps=64,
               batch=16, heads=8)
  records = [
      dict(base, variant='floor', dtype='float32', step_ms=100.,
           matmul_gflop=40.3, peak_gflops=403.),
      dict(base, variant='unrolled', dtype='float32', step_ms=150.),
      dict(base, variant='unrolled+jit', dtype='float32', step_ms=140.),
      dict(base, variant='lingvo', dtype='float32', step_ms=3000.),
      dict(torch, variant='torch/plain', dtype='float32', step_ms=120.),
      dict(torch, variant='torch/gpipe', dtype='float32', step_ms=200.,
           loss='last_cell'),
      dict(base, variant='floor', dtype='bfloat16', step_ms=50.,
           matmul_gflop=40.3, peak_gflops=806.),
      dict(base, variant='unrolled', dtype='bfloat16', step_ms=75.),
      dict(torch, variant='torch/plain', dtype='bfloat16', step_ms=60.),
  ]
  lines = transformer_report.MarkdownLadder(records).splitlines()
  assert 'GEMM floor ms' in lines[0] and 'x floor' in lines[0]
  assert lines[2] == (
      '| 512, 2048, 64, 16, 8 | 4, 2, 4 | float32 | 100.0 (40.3, 403.0) | '
      '150.0 (1.50x) | unrolled+jit: 140.0 (1.40x) | 120.0 (1.20x) | 1.25x | '
      '200.0 (2.00x) / - | 3000.0 (30.00x) | - |')
  assert lines[3] == (
      '| 512, 2048, 64, 16, 8 | 4, 2, 4 | bfloat16 | 50.0 (40.3, 806.0) | '
      '75.0 (1.50x) | unrolled: 75.0 (1.50x) | 60.0 (1.20x) | 1.25x | - | - | '
      '0.50x |')


def test_bad_sizes_are_one_line_exit_2():
  script = os.path.join(_REPO, 'bench', 'transformer.py')
  for args, text in (
      (['--d_model', '64', '512', '--hidden', '128'],
       '--hidden: 1 values for 2 --d_model values'),
      (['--batch', '6', '--M', '4'], '--M 4 does not divide --batch 6'),
      (['--d_model', '100', '--heads', '8'], 'd_model divisible by --heads 8')):
    res = subprocess.run([sys.executable, script] + args, capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 2, (args, res.stderr)
    assert text in res.stderr.strip().splitlines()[-1], res.stderr


def test_rounds_keep_each_configuration_s_fastest_round():
  base = dict(L=4, K=2, M=4, loss='after', dtype='float32', d_model=512)
  rounds = [
      [dict(base, variant='unrolled', step_ms=150., op_ms=1.),
       dict(base, variant='floor', step_ms=100.),
       dict(base, variant='unrolled', dtype='bfloat16', error='timeout')],
      [dict(base, variant='unrolled', step_ms=120., op_ms=2.),
       dict(base, variant='floor', step_ms=110.),
       dict(base, variant='unrolled', dtype='bfloat16', step_ms=90.)]]
  out = transformer_report.Fastest(rounds)
  assert [(r['variant'], r['dtype'], r['step_ms'], r['step_ms_rounds'])
          for r in out] == [('unrolled', 'float32', 120., [150., 120.]),
                            ('floor', 'float32', 100., [100., 110.]),
                            ('unrolled', 'bfloat16', 90., [90.])]
  assert out[0]['op_ms'] == 2. and 'error' not in out[2]
  assert 'error' in transformer_report.Fastest([rounds[0]])[2]
