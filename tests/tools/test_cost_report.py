"""Tests of lingvo_ext.tools.cost_report."""

import json
import os
import sys

from lingvo import model_registry
from lingvo.core import base_input_generator
from lingvo.core import base_model
from lingvo.core import base_model_params
from lingvo.core import tshape
import pytest

from lingvo_ext import layers
from lingvo_ext.pipeline import cost
from lingvo_ext.pipeline import partitioning
from lingvo_ext.tools import cost_report
from tests.support import ROOT as _REPO
from tests.support import zygote


def _Stack():
  fc = layers.FCLayer.Params()
  return [
      fc.Copy().Set(name='fc0', input_dim=32, output_dim=64,
                    activation='RELU'),
      fc.Copy().Set(name='fc1', input_dim=64, output_dim=64,
                    activation='GELU'),
      layers.TransformerLayer.Params().Set(
          name='tr', model_dim=64, num_heads=4, hidden_dim=128),
      fc.Copy().Set(name='fc2', input_dim=64, output_dim=8),
  ]


class _TinyTask(base_model.BaseTask):
  """A task with only what cost_report needs: LayerStack."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_partitions', 2, 'Default number of cells.')
    return p

  @classmethod
  def LayerStack(cls, task_params):
    return _Stack(), (tshape.Shape([task_params.input.batch_size, 4, 32]),)


@model_registry.RegisterSingleTaskModel
class CostReportTinyModel(base_model_params.SingleTaskModelParams):

  def Train(self):
    return base_input_generator.BaseInputGenerator.Params().Set(batch_size=2)

  def Task(self):
    return _TinyTask.Params().Set(name='tiny')


# pylint: disable=protected-access
_KEY = model_registry._ModelRegistryHelper._ModelParamsClassKey(
    CostReportTinyModel)
# pylint: enable=protected-access


def test_report_keys_and_totals():
  shape = tshape.Shape([2, 4, 32])
  report = cost_report.BuildReport(_Stack(), (shape,), 2)
  assert {'layers', 'partitions', 'total_flops',
          'bottleneck_over_mean'} <= set(report)
  for l in report['layers']:
    assert {'name', 'cls', 'flops', 'params', 'out_shapes',
            'partition'} <= set(l)
  assert [l['name'] for l in report['layers']] == ['fc0', 'fc1', 'tr', 'fc2']
  assert report['layers'][2]['cls'] == 'TransformerLayer'
  assert report['layers'][2]['out_shapes'] == [[2, 4, 64]]
  assert report['layers'][3]['activation_bytes'] == 2 * 4 * 8 * 4
  assert report['layers'][0]['params'] == 32 * 64 + 64
  flops = cost.LayerCosts(_Stack(), shape)
  assert [l['flops'] for l in report['layers']] == flops
  sizes = partitioning.MinMaxPartition(flops, 2)
  assert [p['num_layers'] for p in report['partitions']] == sizes
  assert [l['partition'] for l in report['layers']] == [
      i for i, n in enumerate(sizes) for _ in range(n)]
  assert all('flops' in p for p in report['partitions'])
  assert sum(p['flops'] for p in report['partitions']) == sum(flops)
  assert report['total_flops'] == sum(flops)
  cells = [p['flops'] for p in report['partitions']]
  assert report['bottleneck_over_mean'] == pytest.approx(
      max(cells) / (sum(cells) / 2))
  json.dumps(report)  # JSON-able.


def test_report_other_costs_and_verify():
  shape = tshape.Shape([2, 4, 32])
  report = cost_report.BuildReport(_Stack(), (shape,), 3, cost='params',
                                   verify=True)
  assert report['cost'] == 'params'
  assert [l['cost'] for l in report['layers']] == [
      4.0 * l['params'] for l in report['layers']]
  for l in report['layers']:
    # Equal up to the documented unprofiled activation FLOPs (< 2% here).
    assert abs(l['flops'] - l['tf_profiler_flops']) <= 0.02 * l['flops']
  p = _Stack()[0]
  assert report['layers'][0]['tf_profiler_flops'] == (
      report['layers'][0]['flops'] - p.cls.UnprofiledFlops(p, shape))
  text = cost_report.FormatReport(report)
  assert 'TF profiler FLOPs' in text and 'slowest cell / mean' in text
  with pytest.raises(ValueError, match='cost'):
    cost_report.BuildReport(_Stack(), (shape,), 2, cost='latency')


def test_text_and_plot(tmp_path):
  shape = tshape.Shape([2, 4, 32])
  report = cost_report.BuildReport(_Stack(), (shape,), 2)
  text = cost_report.FormatReport(report, title='tiny')
  for word in ('fc0', 'TransformerLayer', '2x4x64', 'cell', 'total FLOPs',
               'slowest cell / mean (flops)'):
    assert word in text
  path = str(tmp_path / 'cells.png')
  cost_report.PlotReport(report, path, title='tiny')
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_main_on_registered_model(capsys, tmp_path):
  path = str(tmp_path / 'p.png')
  assert cost_report.main(
      ['--model=%s' % _KEY, '--json', '--verify', '--plot', path]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report['num_partitions'] == 2  # The task's num_partitions.
  assert report['model'] == _KEY
  assert report['input_shapes'] == [[2, 4, 32]]
  assert all('tf_profiler_flops' in l for l in report['layers'])
  assert os.path.getsize(path) > 0
  assert cost_report.main(['--model=%s' % _KEY, '--num_partitions=3']) == 0
  text = capsys.readouterr().out
  assert '3 cells balanced by flops' in text


@pytest.mark.e2e
def test_cli_json_on_lm_model():
  # The real entry point, on a registered lingvo_ext experiment.
  out = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.tools.cost_report',
       '--model=lm.TransformerLmTiny', '--num_partitions=2', '--json'],
      cwd=_REPO, capture_output=True, text=True, timeout=300, check=True)
  report = json.loads(out.stdout)
  assert {'layers', 'partitions', 'total_flops',
          'bottleneck_over_mean'} <= set(report)
  assert [l['cls'] for l in report['layers']][0] == 'EmbeddingLayer'
  assert len(report['partitions']) == 2
  assert report['total_flops'] == sum(p['flops'] for p in report['partitions'])
  assert report['bottleneck_over_mean'] >= 1.0
