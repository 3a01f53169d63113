"""Tests of lingvo_ext.pipeline.cost: formulas, LayerCosts for each cost choice."""

import functools

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils
from lingvo.core import tshape
import pytest

from lingvo_ext import layers
from lingvo_ext.core import gpipe
from lingvo_ext.layers import flops
from lingvo_ext.pipeline import cost
from lingvo_ext.pipeline import partitioning


class ManySmallOpsLayer(base_layer.BaseLayer):
  """Cheap in FLOPs, slow in time: a long chain of scalar ops.

  Each op costs one FLOP but a whole kernel launch / executor step, the
  pattern that misleads a FLOP-balanced partition.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_ops', 1000, 'Length of the chain of scalar ops.')
    return p

  def FProp(self, theta, inputs):
    del theta
    s = inputs[0, 0]
    for _ in range(self.params.num_ops):
      s = tf.sin(s)
    return inputs + s

  @classmethod
  def FPropMeta(cls, p, inputs):
    flops = p.num_ops + inputs.num_elements()
    return py_utils.NestedMap(flops=flops, out_shapes=(inputs,))


def _FC(name, d):
  return layers.FCLayer.Params().Set(name=name, input_dim=d, output_dim=d)


def _LmStack(vocab=40, d=16, seq=8):
  return [
      layers.EmbeddingLayer.Params().Set(
          name='emb', vocab_size=vocab, embedding_dim=d, max_seq_len=seq),
      layers.TransformerLayer.Params().Set(
          name='tr', model_dim=d, num_heads=2, hidden_dim=4 * d,
          mask_self_atten=True),
      layers.SoftmaxLayer.Params().Set(
          name='sm', input_dim=d, num_classes=vocab, apply_layer_norm=True),
  ]


def test_formulas():
  assert flops.MatMulFlops(3, 4, 5) == 120
  assert flops.FCFlops(10, 8, 4, 'RELU') == 2 * 10 * 8 * 4 + 40 + 40
  assert flops.FCFlops(10, 8, 4, 'GELU', has_bias=False) == 640 + 8 * 40
  assert flops.LayerNormFlops(6 * 8, 8) == 8 * 48 + 3 * 6
  assert flops.SoftmaxFlops(7) == 35
  # B=2, T=4, D=8, N=2: scale 64, QK^T + AV 2*2*(2*8*8*4)=1024... per formula.
  assert flops.AttentionFlops(2, 4, 4, 8, 2) == 64 + 2 * 2 * 8 * 8 * 4 + 5 * 64
  assert flops.AttentionFlops(2, 4, 4, 8, 2, causal=True) == (
      flops.AttentionFlops(2, 4, 4, 8, 2) + 64)
  assert flops.Conv2DOutputSize(9, 3, 2, 'SAME') == 5
  assert flops.Conv2DOutputSize(9, 3, 2, 'VALID') == 4
  assert flops.Conv2DFlops(1, 2, 2, 3, 3, 4, 5) == 2 * 20 * 36
  assert flops.PoolFlops(10, 2, 3) == 60
  with pytest.raises(ValueError, match='activation'):
    flops.ActivationFlops('SWISH', 3)
  with pytest.raises(ValueError, match='padding'):
    flops.Conv2DOutputSize(3, 3, 1, 'FULL')


def test_flops_costs_thread_shapes():
  stack = _LmStack()
  shape = tshape.Shape([2, 8])
  costs = cost.LayerCosts(stack, shape)  # cost='flops' is the default.
  metas = cost.LayerMetas(stack, shape)
  assert costs == [float(m.flops) for m in metas]
  assert all(isinstance(c, float) for c in costs)
  assert metas[1].in_shapes[0].ToTensorShape().as_list() == [2, 8, 16]
  assert metas[2].out_shapes[0].ToTensorShape().as_list() == [2, 8, 40]
  assert costs[1] == flops.TransformerFlops(2, 8, 16, 2, 64, causal=True)


def test_params_costs_are_bytes():
  d, f, vocab, seq = 16, 64, 40, 8
  costs = cost.LayerCosts(_LmStack(vocab, d, seq), tshape.Shape([2, seq]),
                          cost='params')
  emb = vocab * d + seq * d
  tr = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
  sm = 2 * d + d * vocab + vocab
  assert costs == [4.0 * emb, 4.0 * tr, 4.0 * sm]
  assert cost.ParamCount(_LmStack(vocab, d, seq)[1]) == tr
  pool = layers.PoolingLayer.Params().Set(name='pool')
  assert cost.LayerCosts([pool], tshape.Shape([1, 4, 4, 1]),
                         cost='params') == [0.0]


def test_nested_cells_cost_like_their_layers():
  stack = _LmStack()
  shape = tshape.Shape([2, 8])
  cell = lingvo_gpipe.FeatureExtractionLayer.Params().Set(
      name='cell', sub=[s.Copy() for s in stack[:2]])
  flat = cost.LayerCosts(stack, shape)
  nested = cost.LayerCosts([cell, stack[2]], shape)
  assert nested == [flat[0] + flat[1], flat[2]]
  flat_p = cost.LayerCosts(stack, shape, cost='params')
  nested_p = cost.LayerCosts([cell, stack[2]], shape, cost='params')
  assert nested_p == [flat_p[0] + flat_p[1], flat_p[2]]
  # Timing a cell whose first layer needs in-range int ids works too.
  t = cost.LayerCosts([cell], shape, cost='time', num_repeats=1,
                      num_warmup=0)
  assert len(t) == 1 and t[0] > 0


def test_bad_arguments():
  stack = _LmStack()
  shape = tshape.Shape([2, 8])
  with pytest.raises(ValueError, match=r"cost='bytes'.*flops, params, time"):
    cost.LayerCosts(stack, shape, cost='bytes')
  with pytest.raises(ValueError, match='num_repeats'):
    cost.LayerCosts(stack, shape, cost='time', num_repeats=0)
  with pytest.raises(ValueError, match='num_repeats'):
    cost.LayerCosts(stack, shape, cost='time', num_repeats=1000)
  with pytest.raises(ValueError, match='symbolic'):
    cost.LayerCosts(stack, tshape.Shape(['batch', 8]))


def test_time_costs_use_measure_fn_and_device():
  stack = _LmStack()
  shape = tshape.Shape([2, 8])
  calls = []

  def FakeMeasure(p, *shapes, **kw):
    calls.append((p.name, [s.ToTensorShape().as_list() for s in shapes], kw))
    return float(len(calls))

  costs = cost.LayerCosts(stack, shape, cost='time', device='/cpu:0',
                          num_repeats=3, measure_fn=FakeMeasure)
  assert costs == [1.0, 2.0, 3.0]
  assert [c[1] for c in calls] == [[[2, 8]], [[2, 8, 16]], [[2, 8, 16]]]
  assert calls[0][2]['device'] == '/cpu:0'
  assert calls[0][2]['num_repeats'] == 3
  # The real measurement, on the requested device: seconds less the fixed
  # Session.run overhead, clamped at 0. Under load the overhead's median may
  # outlast a small layer's, so any layer may read 0 here...
  real = cost.LayerCosts(stack, shape, cost='time', device='/cpu:0',
                         num_repeats=2)
  assert len(real) == 3 and all(t >= 0 for t in real)
  # ...but the run itself always takes time: without the subtraction, each
  # layer's forward+backward is positive.
  raw = [cost.MeasureLayerTime(p, *m.in_shapes, device='/cpu:0',
                               num_repeats=2, subtract_overhead=False)
         for p, m in zip(stack, cost.LayerMetas(stack, shape))]
  assert all(t > 0 for t in raw), raw


def _Bottleneck(costs, sizes):
  return partitioning.Bottleneck(costs, sizes) / (sum(costs) / len(sizes))


def _LeastLoadedTimes(stack, shape, attempts=3):
  """Per-layer seconds, the fixed Session.run overhead included.

  Load on the machine only ever adds time, so each layer's minimum over a
  few measurements is the closest to its cost; a second measurement is
  taken only when the first does not show the slow layers as slow.
  Without the overhead subtracted, no layer can come out as 0 s.
  """
  measure = functools.partial(cost.MeasureLayerTime, subtract_overhead=False)
  best = None
  for _ in range(attempts):
    times = cost.LayerCosts(stack, shape, cost='time', num_repeats=7,
                            measure_fn=measure)
    best = times if best is None else [min(a, b) for a, b in zip(best, times)]
    if min(best[2:]) > best[0] + best[1]:
      break
  return best


def test_time_cost_balances_flop_cheap_but_slow_layers():
  # Two FLOP-heavy but fast FC layers, then two FLOP-cheap but slow layers.
  d = 128
  stack = [_FC('fc0', d), _FC('fc1', d)] + [
      ManySmallOpsLayer.Params().Set(name='slow%d' % i) for i in range(2)
  ]
  shape = tshape.Shape([16, d])
  flops = cost.LayerCosts(stack, shape)
  times = _LeastLoadedTimes(stack, shape)
  assert max(flops[2:]) < 0.01 * min(flops[:2])  # Cheap in FLOPs...
  # ...but slow: each slow layer outlasts both FC layers together (each time
  # includes one Session.run overhead, so the FC side carries two), which
  # makes [3, 1] the only balanced split: each cell gets one slow layer.
  assert min(times[2:]) > times[0] + times[1], times

  by_flops = partitioning.MinMaxPartition(flops, 2)
  by_time = partitioning.MinMaxPartition(times, 2)
  # FLOPs put both slow layers in one cell; time gives each cell one.
  assert by_flops == [1, 3]
  assert by_time == [3, 1]
  assert _Bottleneck(times, by_time) < _Bottleneck(times, by_flops)

  # PartitionSequentialLayers takes the same choice.
  measured = iter(times)  # LayerCosts measures the layers in order.
  cells = gpipe.PartitionSequentialLayers(
      stack, 2, shape, cost='time', measure_fn=lambda *a, **kw: next(measured))
  assert [len(c.sub) for c in cells] == [3, 1]
  cells = gpipe.PartitionSequentialLayers(stack, 2, shape)
  assert [len(c.sub) for c in cells] == [1, 3]


class _CostsInInitLayer(base_layer.BaseLayer):
  """Computes costs in __init__, as a task partitioning its stack does."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stack', [], 'Layers to cost, then to create as children.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    shape = tshape.Shape([2, 8])
    self.costs = {
        c: cost.LayerCosts(p.stack, shape, cost=c, num_repeats=1)
        for c in cost.COST_CHOICES
    }
    self.profiled = cost.TfProfilerFlops(p.stack[0], shape)
    self.CreateChildren('stack', p.stack)


def test_costs_while_a_layer_is_being_built():
  p = _CostsInInitLayer.Params().Set(name='outer', stack=_LmStack())
  with tf.Graph().as_default():
    layer = p.Instantiate()
    # Only the real children were recorded, and variables only in this graph.
    assert list(layer.children) == ['stack']
    assert len(layer.vars.Flatten()) == len(
        tf.global_variables()) == 2 + 12 + 4
  assert all(len(v) == 3 for v in layer.costs.values())
  assert layer.profiled == layer.costs['flops'][0]
