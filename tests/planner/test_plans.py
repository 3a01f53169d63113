"""The plans the planner lists (plans.py) and sizes (model_profile.py)."""

import dataclasses

import pytest

from lingvo_ext import planner
from tests.support import planner_testlib as lib


@pytest.mark.parametrize('devices', [1, 2, 3, 4, 8])
def test_enumeration_respects_devices(devices):
  plans = planner.Enumerate(lib.Profile(), devices)
  assert plans
  for p in plans:
    assert p.devices_per_replica * p.replicas <= devices
    if p.num_cells == p.devices_per_replica:
      assert p.num_cells * p.replicas <= devices
    else:  # Several cells per device: only these schedules fold them.
      assert p.schedule in ('interleaved_1f1b', 'zero_bubble', 'zbv')
      assert p.num_cells % p.devices_per_replica == 0
      assert p.num_cells > p.devices_per_replica
    assert sum(p.sizes) == 8 and len(p.sizes) == p.num_cells
    assert (p.global_batch // p.replicas) % p.num_micro_batches == 0
  # Every K * R <= N is offered (K = D), and nothing more.
  kr = {(p.num_cells, p.replicas) for p in plans
        if p.num_cells == p.devices_per_replica}
  assert kr == {(k, r) for k in range(1, devices + 1)
                for r in range(1, devices // k + 1) if 32 % r == 0}


def test_enumeration_uses_the_exact_cut():
  profile = planner.ModelProfile(
      name='uneven', batch=8, in_bytes=4.,
      layers=tuple(lib.Layer('l%d' % i, flops=f)
                   for i, f in enumerate([1, 1, 1, 6, 1, 1, 1, 1])))
  plans = planner.Enumerate(profile, 2)
  cuts = {p.num_cells: p.sizes for p in plans}
  # The exact min-max cut: {1,1,1,6 | 1,1,1,1} has a bottleneck of 9, the
  # least possible.
  assert cuts[2] == (4, 4)
  assert cuts[1] == (8,)


def test_enumeration_offers_schedules_the_loss_allows():
  nonlinear = {(p.schedule, p.recompute)
               for p in planner.Enumerate(lib.Profile(linear_loss=False), 4)}
  # No backward pass before every forward: '1f1b' recomputes.
  assert ('1f1b', False) not in nonlinear and ('1f1b', True) in nonlinear
  assert ('recurrent', False) not in nonlinear
  assert {('zero_bubble', False), ('interleaved_1f1b', False),
          ('unrolled', True), ('unrolled', False)} <= nonlinear
  linear = {(p.schedule, p.recompute)
            for p in planner.Enumerate(lib.Profile(), 4)}
  assert {('zero_bubble', False), ('interleaved_1f1b', False),
          ('1f1b', False), ('unrolled', True)} <= linear


def test_nonlinear_loss_runs_forwards_first():
  """zero_bubble with a loss not linear in the outputs: all forwards first,
  so every micro-batch is alive at once, as under GPipe."""
  plan = lib.Plan(4, 8, 'zero_bubble')
  linear = planner.Predict(lib.Profile(kept=4096.), plan, lib.FLOPS_ONLY)
  nonlinear = planner.Predict(lib.Profile(kept=4096., linear_loss=False),
                              dataclasses.replace(plan), lib.FLOPS_ONLY)
  gpipe = planner.Predict(lib.Profile(kept=4096., linear_loss=False),
                          lib.Plan(4, 8), lib.FLOPS_ONLY)
  assert nonlinear.peak_bytes == gpipe.peak_bytes > linear.peak_bytes


@pytest.mark.parametrize('text,size', [('512MB', 512 * 2**20), ('2G', 2**31),
                                       ('1.5GiB', int(1.5 * 2**30)),
                                       ('300000', 300000), ('64 kb', 65536)])
def test_parse_size(text, size):
  assert planner.ParseSize(text) == size


@pytest.mark.parametrize('text', ['2XB', 'MB', '-1GB', '0', '1.2.3MB', ''])
def test_parse_size_rejects(text):
  with pytest.raises(ValueError, match='512MB'):
    planner.ParseSize(text)
