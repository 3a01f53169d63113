"""bench/torch_baselines.py --model transformer: the parts that run without torch
(sizes, data, stage splits, records, wiring into bench/transformer.py)."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from bench import torch_baselines
from bench import torch_common  # pylint: disable=g-import-not-at-top
from bench import transformer
from bench import transformer_report  # pylint: disable=g-import-not-at-top
from tests.support import ROOT as _REPO

_SCRIPT = os.path.join(_REPO, 'bench', 'torch_baselines.py')


def test_same_sizes_and_data_as_bench_transformer():
  t = torch_common.TRANSFORMER
  assert (t['time_steps'], t['model_dim'], t['hidden'], t['heads'],
          t['vocab']) == (transformer.T, transformer.D, transformer.HIDDEN,
                          transformer.HEADS, transformer.VOCAB)
  assert torch_baselines.TRANSFORMER_DEFAULTS['batch'] == transformer.B
  ids, labels = torch_common.TransformerData(transformer.B)
  # bench/transformer.py draws [time, batch] ids, then labels, from seed 0.
  rng = np.random.RandomState(0)
  np.testing.assert_array_equal(
      ids, rng.randint(0, transformer.VOCAB, [transformer.T, transformer.B]).T)
  np.testing.assert_array_equal(
      labels,
      rng.randint(0, transformer.VOCAB, [transformer.T, transformer.B]).T)
  assert ids.shape == (32, 16) and ids.dtype == np.int64


def test_positional_embedding_is_lingvos_sin_then_cos():
  pos = torch_common.PositionalEmbedding(16, 64)
  assert pos.shape == (16, 64)
  np.testing.assert_allclose(pos[0], [0.] * 32 + [1.] * 32)
  # Timescales 1 .. 1e4 over 32 frequencies: position 1's first and last.
  assert pos[1, 0] == pytest.approx(math.sin(1.))
  assert pos[1, 31] == pytest.approx(math.sin(1e-4))
  assert pos[3, 32] == pytest.approx(math.cos(3.))


def test_stage_splits_follow_gpipe_transformer_stack():
  # splits=K: ceil(L / K) layers per stage, the remainder in the last.
  assert torch_common.TransformerSplits(8, 2) == [4, 8]
  assert torch_common.TransformerSplits(32, 4) == [8, 16, 24, 32]
  assert torch_common.TransformerSplits(8, 3) == [3, 6, 8]
  assert torch_common.TransformerSplits(8, 1) == [8]


def test_transformer_defaults_and_bad_flags(capsys):
  args = torch_baselines.ParseArgs(['--model', 'transformer'])
  assert (args.batch, args.layers, args.K, args.M, args.width) == (32, 8, [2],
                                                                   [4], None)
  # Unlike the FC model, any K up to L is GPipeTransformerStack's split.
  assert torch_baselines.ParseArgs(['--model', 'transformer', '--K',
                                    '3']).K == [3]
  fc = torch_baselines.ParseArgs([])
  assert (fc.width, fc.batch, fc.K, fc.M) == (1536, 128, [2], [4, 16])
  for argv, msg in (
      (['--width', '64'], '--width is for --model homogeneous'),
      (['--K', '9'], '--K 9 is more stages than --layers 8'),
      (['--M', '5'], '--batch 32 is not divisible by M=5')):
    with pytest.raises(SystemExit) as e:
      torch_baselines.ParseArgs(['--model', 'transformer'] + argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_without_torch_is_one_line_exit_2():
  # sys.modules['torch'] = None makes `import torch` fail even where torch is
  # installed: this never runs torch.
  out = subprocess.run(
      [sys.executable, '-c',
       'import runpy, sys; sys.modules["torch"] = None; sys.argv = [%r, '
       '"--model", "transformer"]; runpy.run_path(%r, run_name="__main__")' %
       (_SCRIPT, _SCRIPT)], capture_output=True, text=True, timeout=60,
      check=False)
  assert out.returncode == 2
  assert out.stderr.count('\n') == 1
  assert 'torch is not installed' in out.stderr


def _Record(**kw):
  job = dict(impl=kw.pop('impl'), K=kw.pop('K'), M=kw.pop('M'), threads=1)
  args = torch_baselines.ParseArgs(['--model', 'transformer', '--layers',
                                    '8'])
  return torch_common.Record(job, args, [0.03, 0.01, 0.02], 1920.5,
                                [300., 310.], [200., 200.], {}, 0.456)


def test_records_render_in_bench_transformer_markdown():
  rec = _Record(impl='torch/gpipe', K=2, M=4)
  assert (rec['variant'], rec['L'], rec['ops'], rec['step_ms'],
          rec['first_step_s'], rec['peak_rss_mb'], rec['model']) == (
              'torch/gpipe', 8, None, 20.0, 0.46, 610.0, 'transformer')
  lingvo = dict(variant='lingvo', L=8, K=2, M=4, ops=5569, first_step_s=14.,
                step_ms=40., peak_rss_mb=1093)
  lines = transformer_report.Markdown(
      torch_common.MergeByConfig([lingvo, dict(lingvo, K=4, M=16)],
                                    [rec])).splitlines()
  # torch's records have no CPU time a step.
  assert lines[3] == ('| 8, 2, 4 | torch/gpipe, loss in last cell | - | 0.5 | '
                      '20.0 | - | 610 | - | 0.50x |  |')
  assert lines[4].startswith('| 8, 4, 16 | lingvo |')
  assert '| torch/gpipe | 2 | 4 | 2 x 1 | 20.0 (15.0-25.0) | - | 0.46 | 1920.5 |' in (
      torch_common.Markdown([rec]))


def test_transformer_records_run_the_torch_python(tmp_path):
  # A stand-in for the torch python: it logs its argv and prints one record.
  fake = tmp_path / 'python'
  fake.write_text(
      '#!/bin/sh\necho "$@" >> %s\n'
      'echo \'{"impl": "torch/plain", "variant": "torch/plain", "L": 8, '
      '"K": 1, "M": 1}\'\n' % (tmp_path / 'argv'))
  fake.chmod(0o755)
  recs = torch_common.WithTransformerRecords(
      [dict(variant='lingvo', L=8, K=2, M=4)], str(fake), [8], [(2, 4)],
      steps=5)
  # The unpipelined model's row goes with the configuration it ran beside.
  assert [(r['variant'], r['K'], r['M']) for r in recs] == [
      ('lingvo', 2, 4), ('torch/plain', 2, 4)]
  argv = (tmp_path / 'argv').read_text().split()
  assert argv[1:] == ['--model', 'transformer', '--layers', '8', '--K', '2',
                      '--M', '4', '--steps', '5', '--timeout_s', '600']
  fake.write_text('#!/bin/sh\necho boom >&2\nexit 3\n')
  recs = torch_common.TransformerRecords(str(fake), [8], [(2, 4)], 5)
  assert recs == [dict(variant='torch', L=8, K=2, M=4, error='exit 3: boom')]
  assert torch_common.WithTransformerRecords([], None, [8], [(2, 4)],
                                                5) == []


def test_bench_transformer_bad_torch_python_is_one_line_exit_2():
  res = subprocess.run(
      [sys.executable, os.path.join(_REPO, 'bench', 'transformer.py'),
       '--torch_python', '/nonexistent/python'], capture_output=True,
      text=True, timeout=60, check=False)
  assert res.returncode == 2
  assert '--torch_python /nonexistent/python is not an executable' in (
      res.stderr)
  assert res.stdout == ''
