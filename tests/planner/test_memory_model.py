"""The peak-RSS model's formula (planner/memory_model.py) and its probe's
cache (planner/memory_probe.py)."""

import dataclasses
import json

from lingvo_ext import planner
from lingvo_ext.planner import memory_model
from lingvo_ext.planner import memory_probe


def _Profile():
  """Two layers of 10 parameter bytes, 100 kept bytes per example, 1000
  float ops each way; input 8 bytes per example; Adam (2 slots)."""
  layers = tuple(planner.LayerProfile(
      name=f'l{i}', flops=1e6, fwd_ops=10, bwd_ops=20, param_bytes=10,
      num_vars=1, out_bytes=100., kept_bytes=100.) for i in range(2))
  return planner.ModelProfile(name='m', layers=layers, batch=16, in_bytes=8.,
                              optimizer_slots=2, linear_loss=True,
                              cell_functions=False)


def testTermsFollowTheFormulaAndAddUpToTheTotal():
  c = memory_model.Constants(runtime_bytes=1000., activation_factor=1.5,
                             bytes_per_op=2.)
  # One cell, one micro-batch of 16: each layer keeps 100 bytes per
  # example; the output and its gradient wait for the loss (2 * 100).
  plan = planner.Plan(num_cells=1, sizes=(2,), devices_per_replica=1,
                      num_micro_batches=1, schedule='unrolled',
                      recompute=False, replicas=1, gradient_sync='shared',
                      global_batch=16)
  got = memory_model.Predict(_Profile(), plan, c)
  kept = 16 * (100 + 100) + 16 * 8 + 2 * 100 * 16
  # The layers' ops per micro-batch, the loss's, 12 per variable; the
  # training graph's nodes: 1.5 per op, 56 per variable, 400 besides.
  ops = 1 * (10 + 20) * 2 + _Profile().loss_ops + 2 * 12
  nodes = 1.5 * ops + 56 * 2 + 400
  assert got.Terms() == {
      'runtime': 1000., 'variables': 20., 'gradients': 20.,
      'optimizer_slots': 40., 'activations': 1.5 * kept,
      # The largest layer's kept bytes of one micro-batch, as gradients.
      'transient': 1.5 * 16 * 100,
      # One run of weight gradients, no recompute: nothing more.
      'gradient_buffers': 0., 'recompute_outputs': 0.,
      'input_pipeline': 2 * 8 * 16, 'input_buffer': 0., 'graph': 2. * nodes}
  assert [n for n, _ in got.terms] == list(memory_model.TERM_NAMES)
  assert got.rss_bytes == sum(got.Terms().values())
  # Four micro-batches under 'unrolled' keep the same whole batch; the
  # transient peak is one micro-batch's.
  four = memory_model.Predict(_Profile(), planner.Plan(
      num_cells=1, sizes=(2,), devices_per_replica=1, num_micro_batches=4,
      schedule='unrolled', recompute=False, replicas=1,
      gradient_sync='shared', global_batch=16), c).Terms()
  assert four['activations'] == 1.5 * kept
  assert four['transient'] == 1.5 * 4 * 100


def testRecomputeHoldsEachMicroBatchsGradientsAndEveryLayersOutput():
  c = memory_model.Constants(runtime_bytes=1000., activation_factor=1.5,
                             bytes_per_op=2.)
  plan = planner.Plan(num_cells=1, sizes=(2,), devices_per_replica=1,
                      num_micro_batches=4, schedule='unrolled',
                      recompute=True, replicas=1, gradient_sync='shared',
                      global_batch=16)
  got = memory_model.Predict(_Profile(), plan, c)
  terms = got.Terms()
  # Each of the 4 micro-batches' backward passes makes its own weight
  # gradients (20 bytes); 3 are added to the first's sum.
  assert planner.Accumulations(plan) == 3
  assert terms['gradient_buffers'] == 1.5 * 20 * 3
  # Both layers' outputs (100 bytes per example) of all 16 examples.
  assert terms['recompute_outputs'] == 1.5 * 2 * 100 * 16
  assert got.rss_bytes == sum(terms.values())
  # Two replicas: twice the model's terms, the runtime once.
  two = memory_model.Predict(_Profile(), dataclasses.replace(
      plan, replicas=2, global_batch=32), c).Terms()
  assert two['gradient_buffers'] == 2 * terms['gradient_buffers']
  assert two['recompute_outputs'] == 2 * terms['recompute_outputs']


def testTwoPipelinesCountTheRuntimeOnce():
  c = memory_model.Constants(runtime_bytes=1000., activation_factor=1.,
                             bytes_per_op=0.)
  plan = planner.Plan(num_cells=1, sizes=(2,), devices_per_replica=1,
                      num_micro_batches=1, schedule='unrolled',
                      recompute=False, replicas=1, gradient_sync='shared',
                      global_batch=16)
  one = memory_model.Predict(_Profile(), plan, c)
  both = one.Plus(one)
  assert both.Terms()['runtime'] == 1000.
  assert both.rss_bytes == 2 * one.rss_bytes - 1000.
  more = memory_model.Extra(both, 'variables', 5.)
  assert more.rss_bytes == both.rss_bytes + 5.


def testTheProbesConstantsAreCachedPerMachineAndDevices(tmp_path,
                                                        monkeypatch):
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  calls = []

  def Measure(n):
    calls.append(n)
    return dict(runtime_bytes=1e9 + n, activation_factor=1.25,
                bytes_per_op=12288.)

  monkeypatch.setattr(memory_probe, 'Measure', Measure)
  a = memory_probe.Get(2)
  assert (a.runtime_bytes, a.activation_factor) == (1e9 + 2, 1.25)
  assert memory_probe.Get(2) == a and calls == [2]  # Read, not measured.
  assert memory_probe.Get(1).runtime_bytes == 1e9 + 1 and calls == [2, 1]
  with open(memory_probe.CachePath()) as f:
    keys = sorted(json.load(f))
  assert keys == sorted([memory_probe.Key(1), memory_probe.Key(2)])
  assert 'TF ' in keys[0] and 'device(s)' in keys[0]
  memory_probe.Get(2, force=True)
  assert calls == [2, 1, 2]
