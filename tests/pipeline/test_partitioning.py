"""MinMaxPartition is exact; PartitionSequentialLayers is optimal."""

import itertools
import random

from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import layers
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import partitioning
from tests.support import gpipe_testlib as lib


def _BruteForce(costs, k):
  """Least bottleneck over every way to cut `costs` into k non-empty runs."""
  n = len(costs)
  best = None
  for cuts in itertools.combinations(range(1, n), k - 1):
    bounds = (0,) + cuts + (n,)
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    best = worst if best is None else min(best, worst)
  return best


def test_matches_brute_force_on_random_costs():
  rng = random.Random(1234)
  for trial in range(300):
    n = rng.randint(1, 11)
    k = rng.randint(1, n)
    if trial % 3 == 0:
      costs = [rng.randint(0, 9) for _ in range(n)]  # Many ties.
    else:
      costs = [rng.uniform(0, 100) for _ in range(n)]
    sizes = partitioning.MinMaxPartition(costs, k)
    assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1
    got = partitioning.Bottleneck(costs, sizes)
    assert got == pytest.approx(_BruteForce(costs, k), rel=1e-12), (costs, k)


def test_deterministic_tie_break():
  assert partitioning.MinMaxPartition([1] * 24, 8) == [3] * 8
  assert partitioning.MinMaxPartition([0, 0, 0, 0], 2) == [3, 1]
  assert partitioning.MinMaxPartition([5, 1, 1, 1, 5], 3) == [1, 3, 1]
  costs = [random.Random(0).random() for _ in range(40)]
  assert (partitioning.MinMaxPartition(costs, 5) ==
          partitioning.MinMaxPartition(list(costs), 5))


@pytest.mark.parametrize('costs,k,match', [
    ([1, 2], 0, 'num_partitions must be >= 1'),
    ([1, 2], 3, 'num_partitions=3 is more than the 2 items'),
    ([1, -2, 3], 2, r'costs\[1\]=-2'),
    ([1, float('nan')], 1, r'costs\[1\]=nan'),
])
def test_min_max_partition_errors(costs, k, match):
  with pytest.raises(ValueError, match=match):
    partitioning.MinMaxPartition(costs, k)


def _FcStack(widths, batch=16):
  subs = [
      layers.FCLayer.Params().Set(
          name='fc%d' % i, input_dim=a, output_dim=b)
      for i, (a, b) in enumerate(zip(widths, widths[1:]))
  ]
  return subs, lib.Shape(batch, widths[0])


def _PartFlops(parts, shape):
  out = []
  for p in parts:
    meta = p.cls.FPropMeta(p, shape)
    out.append(meta.flops)
    shape = meta.out_shapes[0]
  return out


def test_partition_sequential_layers_optimal_on_uneven_widths():
  rng = random.Random(7)
  for _ in range(8):
    widths = [rng.choice([8, 32, 64, 128, 256]) for _ in range(11)]
    subs, shape = _FcStack(widths)
    per_layer = _PartFlops(subs, shape)
    for k in (2, 3, 4):
      parts = gpipe.PartitionSequentialLayers(subs, k, shape)
      assert len(parts) == k and all(p.sub for p in parts)
      assert [len(p.sub) for p in parts] == partitioning.MinMaxPartition(
          per_layer, k)
      assert max(_PartFlops(parts, shape)) == pytest.approx(
          _BruteForce(per_layer, k))


def test_beats_lingvo_on_24_equal_layers():
  subs, shape = _FcStack([64] * 25)
  ours = gpipe.PartitionSequentialLayers(subs, 8, shape)
  theirs = lingvo_gpipe.PartitionSequentialLayers(
      [s.Copy() for s in subs], 8, shape)
  assert [len(p.sub) for p in ours] == [3] * 8
  assert [len(p.sub) for p in theirs] == [2, 3, 3, 3, 3, 3, 3, 4]
  ratio = max(_PartFlops(theirs, shape)) / max(_PartFlops(ours, shape))
  assert ratio == pytest.approx(4 / 3)


def test_flattens_nested_sequential_with_repeat():
  from lingvo.core import builder_layers  # pylint: disable=g-import-not-at-top
  block = builder_layers.SequentialLayer.Params().Set(
      name='block', repeat=3, sub=_FcStack([8, 8, 8])[0])
  outer = gpipe.FeatureExtractionLayer.Params().Set(
      name='outer', sub=[block, _FcStack([8, 8])[0][0]])
  parts = gpipe.PartitionSequentialLayers(outer, 7, lib.Shape(4, 8))
  assert [len(p.sub) for p in parts] == [1] * 7
  names = [s.name for p in parts for s in p.sub]
  assert names == ['cell_%03d' % i for i in range(7)]


def test_several_input_shapes():
  cells = [lib.TwoStreamLayer.Params().Set(name='t%d' % i, dim=4)
           for i in range(4)]
  parts = gpipe.PartitionSequentialLayers(cells, 2, lib.Shape(2, 4),
                                          lib.Shape(2, 4))
  assert [len(p.sub) for p in parts] == [2, 2]


def test_partition_errors():
  subs, shape = _FcStack([8, 8, 8])
  with pytest.raises(ValueError, match='num_partitions=3 but the stack has '
                     'only 2 layers'):
    gpipe.PartitionSequentialLayers(subs, 3, shape)
  with pytest.raises(ValueError, match='needs the input shapes'):
    gpipe.PartitionSequentialLayers(subs, 2)


def _VariableNames(num_partitions, partition_independent=True):
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  subs, shape = _FcStack([8, 16, 8, 16, 8])
  cells = gpipe.PartitionSequentialLayers(subs, num_partitions, shape)
  with tf.Graph().as_default(), lib.Cluster(num_partitions):
    with tf.variable_scope('model'):
      py_utils.GetOrCreateGlobalStepVar()
      net = gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=cells,
          partition_independent_names=partition_independent).Instantiate()
      return sorted(v.name for v in net.vars.Flatten())


def test_variable_names_do_not_depend_on_partitioning():
  # So a checkpoint restores under any partitioning, and seeded
  # initialisation gives the same weights for every K.
  names = _VariableNames(1)
  assert names == _VariableNames(2) == _VariableNames(4)
  assert 'model/cell_003/w/var:0' in names, names


def test_default_variable_names_are_lingvos():
  # The cell scope stays, as in lingvo.core.gpipe.
  assert 'model/d0/cell_000/w/var:0' in _VariableNames(1, False)
  assert 'model/d1/cell_003/w/var:0' in _VariableNames(2, False)


def test_duplicate_sub_layer_names_across_cells():
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  cells = [
      gpipe.FeatureExtractionLayer.Params().Set(
          name='c%d' % i, sub=[_FcStack([8, 8])[0][0]]) for i in range(2)
  ]
  with tf.Graph().as_default(), lib.Cluster(2):
    with pytest.raises(ValueError, match="cells 'c0' and 'c1' both have a "
                       "sub-layer named 'fc0'.*partition_independent_names"):
      gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=cells,
          partition_independent_names=True).Instantiate()
