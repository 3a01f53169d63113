"""Pipeline vs sequential: outputs and every variable's gradient agree."""

import re

import lingvo.compat as tf
from lingvo.core import layers
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import jit_random
from tests.support import gpipe_testlib as lib

B, D = 8, 6

def _FcCells(num_cells, layers_per_cell=2):
  cells = []
  for c in range(num_cells):
    subs = [
        lib.Fc('fc%d_%d' % (c, j), D, D, seed=10 * c + j)
        for j in range(layers_per_cell)
    ]
    cells.append(
        gpipe.FeatureExtractionLayer.Params().Set(name='cell%d' % c, sub=subs))
  return cells


def _Input(*shape, seed=0):
  return tf.constant(
      np.random.RandomState(seed).randn(*shape).astype(np.float32))


# Every schedule x recompute variant is built in one graph per case and must
# equal the sequential model: outputs and every gradient to 1e-5. The quick
# tier runs 2 devices with 1 and 4 micro-batches and 4 with one.


@pytest.mark.parametrize('num_devices,num_micro', [
    (d, m) if (d == 2 and m in (1, 4)) or (d, m) == (4, 1) else
    pytest.param(d, m, marks=pytest.mark.slow)
    for d in (2, 4) for m in (1, 2, 4, 8)])
def test_matches_sequential(num_devices, num_micro):
  results, seq, names = lib.RunVariants(
      _FcCells(num_devices), num_devices, lambda: (_Input(B, D),),
      num_micro_batches=num_micro)
  assert set(results) == set(lib.VARIANTS)
  assert len(names) == 2 * num_devices * 2  # w and b of every FC layer.
  for name, sg in zip(names, seq[1]):
    assert np.abs(sg).max() > 0, name
  for out, _ in results.values():
    assert out.shape == (B, D)
  lib.AssertVariantsMatch(results, seq, names)


def _TwoStreamCells():
  return [
      gpipe.FeatureExtractionLayer.Params().Set(
          name='cell%d' % c,
          sub=[lib.TwoStreamLayer.Params().Set(name='two%d' % c, dim=D)])
      for c in range(2)
  ]


def test_several_inputs_and_outputs():
  results, seq, names = lib.RunVariants(
      _TwoStreamCells(), 2, lambda: (_Input(B, D), _Input(B, D, seed=1)),
      num_micro_batches=4)
  for out, _ in results.values():
    assert isinstance(out, tuple) and len(out) == 2
  lib.AssertVariantsMatch(results, seq, names)


# The quick tier: a whole output left out (a linear loss: 1f1b without
# recomputation) and some rows under sin (with it); the whole suite also runs
# some rows under the linear loss (marked slow).
@pytest.mark.parametrize('part', [
    'one_output', pytest.param('some_rows', marks=pytest.mark.slow),
    'some_rows_sin'])
def test_differentiating_part_of_the_outputs(part):
  """Batched weight gradients stay right when the loss skips some outputs.

  A loss linear in the outputs takes 1f1b's path without recomputation, sin
  the one with it.
  """
  if part == 'one_output':
    loss_fn = lambda out: lib._Loss(out[0])  # pylint: disable=protected-access
  elif part == 'some_rows':
    # Only the rows of the first micro-batch and a half: the others get zero
    # gradients, some micro-batches only partly.
    loss_fn = lambda out: lib._Loss(out[0][:B * 3 // 8])  # pylint: disable=protected-access
  else:
    loss_fn = lambda out: tf.reduce_sum(tf.sin(out[0][:B * 3 // 8]))
  results, seq, names = lib.RunVariants(
      _TwoStreamCells(), 2, lambda: (_Input(B, D), _Input(B, D, seed=1)),
      variants=lib.VARIANTS + (('1f1b', True),), loss_fn=loss_fn,
      num_micro_batches=4)
  lib.AssertVariantsMatch(results, seq, names)


def test_nested_map_fprop():
  cells = [
      gpipe.FeatureExtractionLayer.Params().Set(
          name='cell%d' % c,
          sub=[lib.NestedMapLayer.Params().Set(name='nm%d' % c, dim=D)])
      for c in range(2)
  ]
  inputs = lambda: (py_utils.NestedMap(a=_Input(B, D), b=_Input(B, D, seed=1)),)
  results, seq, names = lib.RunVariants(
      cells, 2, inputs, num_micro_batches=4, nested_map_fprop=True)
  for out, _ in results.values():
    assert set(out.keys()) == {'a', 'b'}
  lib.AssertVariantsMatch(results, seq, names)


def test_batch_dim_1():
  # Time-major inputs [T, B, D], split along B.
  results, seq, names = lib.RunVariants(
      _FcCells(2), 2, lambda: (_Input(3, B, D),), num_micro_batches=4,
      batch_dim=1)
  for out, _ in results.values():
    assert out.shape == (3, B, D)
  lib.AssertVariantsMatch(results, seq, names)


# XLA-compiled cell functions, as the schedule tests run them.
JIT = (('cell_functions', True), ('jit_compile', True))
JIT_VARIANTS = (('unrolled', False, JIT), ('1f1b', True, JIT))


def ExpectCompiled(monkeypatch):
  """Fails if a jit_compile cell falls back to uncompiled; lists checks."""
  checked = []
  unmatched = jit_random.UnmatchedRandomOps

  def Check(graph):
    out = unmatched(graph)
    assert not out, out
    checked.append(graph.name)
    return out

  monkeypatch.setattr(jit_random, 'UnmatchedRandomOps', Check)
  return checked


def _DropoutCells(num_cells, keep_prob):
  """FC then dropout in every cell, on stateless per-step seeds."""
  cells = []
  for c in range(num_cells):
    subs = [
        lib.Fc('fc%d' % c, D, D, seed=c + 1),
        layers.DeterministicDropoutLayer.Params().Set(
            name='drop%d' % c, keep_prob=keep_prob),
    ]
    cells.append(
        gpipe.FeatureExtractionLayer.Params().Set(name='cell%d' % c, sub=subs))
  return cells


@pytest.mark.parametrize('num_devices,num_micro', [
    (2, 4), pytest.param(4, 8, marks=pytest.mark.slow)])
def test_dropout_same_mask_in_recomputation(num_devices, num_micro,
                                            monkeypatch):
  # With recompute the backward pass rebuilds each cell, dropout included:
  # only if it draws the forward pass's mask do the gradients equal those of
  # the schedule that keeps its activations. '1f1b' without recomputation
  # differentiates its forward pass, as 'unrolled' does.
  compiled = ExpectCompiled(monkeypatch)
  variants = (('unrolled', True), ('1f1b', None), ('1f1b', False),
              ('1f1b', True)) + JIT_VARIANTS
  results, _, names = lib.RunVariants(
      _DropoutCells(num_devices, 0.5), num_devices,
      lambda: (_Input(4 * B, D),),
      variants=(('unrolled', False),) + variants, num_micro_batches=num_micro)
  assert compiled  # Each cell's function traced once, compiled.
  ref_out, ref_grads = results[('unrolled', False)]
  # The last cell ends in dropout: about half the outputs are exactly 0, in
  # different places in each micro-batch.
  zero = ref_out == 0
  assert 0.3 < zero.mean() < 0.7
  assert not np.array_equal(zero[:B], zero[B:2 * B])
  for variant in variants:
    out, grads = results[variant]
    # The same masks, XLA-compiled or not: zeros in the same places.
    np.testing.assert_array_equal(out == 0, zero, err_msg=str(variant))
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(names, grads, ref_grads):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5,
                                 err_msg='%s %s' % (variant, name))


def test_recompute_false_is_an_error_where_always_recomputed():
  with tf.Graph().as_default(), lib.Cluster(2):
    with pytest.raises(ValueError, match='recompute=False'):
      gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=_FcCells(2), schedule='recurrent',
          recompute=False).Instantiate()


def _FunctionsCalled(node):
  """Names of the functions a NodeDef calls (call ops, While/If bodies)."""
  names = set()
  for value in node.attr.values():
    if value.HasField('func'):
      names.add(value.func.name)
    names.update(f.name for f in value.list.func)
  return names


def _PlacementGraph(schedule):
  num_devices = 2
  cells = [
      gpipe.FeatureExtractionLayer.Params().Set(
          name='cell%d' % c,
          sub=[lib.TwoStreamLayer.Params().Set(name='two%d' % c, dim=D)])
      for c in range(num_devices)
  ]
  g = tf.Graph()
  with g.as_default(), lib.Cluster(num_devices):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=2,
        schedule=schedule).Instantiate()
    out = net.FPropDefaultTheta(_Input(B, D), _Input(B, D, seed=1))
    # As Lingvo's py_utils.ComputeGradients does by default.
    grads = tf.gradients(tf.add_n([tf.reduce_sum(o) for o in out]),
                         net.vars.Flatten(), colocate_gradients_with_ops=True)
    init = tf.global_variables_initializer()
  return g, grads, init


def test_recurrent_cell_ops_placed_on_their_device():
  num_devices = 2
  g, _, _ = _PlacementGraph('recurrent')
  graph_def = g.as_graph_def()
  library = {f.signature.name: f for f in graph_def.library.function}

  def Markers(fn_name, seen):
    """Cell markers inside a function, following nested calls."""
    if fn_name in seen or fn_name not in library:
      return set()
    seen.add(fn_name)
    found = set()
    for node in library[fn_name].node_def:
      for c in range(num_devices):
        if node.name.startswith('marker_two%d' % c):
          found.add(c)
      for callee in _FunctionsCalled(node):
        found |= Markers(callee, seen)
    return found

  # Every top-level call that runs a cell's ops is placed on that cell's
  # device; functions with no device inherit their caller's.
  placed = {}
  for node in graph_def.node:
    for callee in _FunctionsCalled(node):
      for c in Markers(callee, set()):
        placed.setdefault(c, set()).add(node.device.split('device:')[-1])
  assert placed == {c: {'CPU:%d' % c} for c in range(num_devices)}, placed


def test_unrolled_cell_ops_run_on_their_device():
  g, grads, init = _PlacementGraph('unrolled')
  meta = tf.RunMetadata()
  with lib.Session(g, 2) as sess:
    sess.run(init)
    sess.run(grads, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
             run_metadata=meta)
  ran = {}  # Runtime device of every op of each cell, forward and backward.
  for dev in meta.step_stats.dev_stats:
    for node in dev.node_stats:
      for c in range(2):
        # Scopes 'cell<c>_mb<t>/...', 'gradients/cell<c>_mb<t>/...' and the
        # cell's per-step weight copy 'cell<c>_theta/...'.
        # The one read of each variable stays with the variable, by design.
        # So does the fetch of a result ('_retval_...'), on the client's.
        if (re.search(r'cell%d_(mb\d+|theta)/' % c, node.node_name) and
            not node.node_name.endswith('/ReadVariableOp') and
            not node.node_name.startswith('_retval_')):
          ran.setdefault(c, set()).add(dev.device.split('device:')[-1])
  assert ran == {0: {'CPU:0'}, 1: {'CPU:1'}}, ran


def test_eval_with_one_device_runs_plainly():
  g = tf.Graph()
  with g.as_default(), lib.Cluster(1), tf.name_scope('eval'):
    from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
    with cluster_factory.SetEval(True):
      py_utils.GetOrCreateGlobalStepVar()
      net = gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=_FcCells(2),
          num_micro_batches=4).Instantiate()
      x = _Input(B, D)
      out = net.FPropDefaultTheta(x)
      seq = net.FPropSequential(net.theta, x)
    op_types = {op.type for op in g.get_operations()}
    init = tf.global_variables_initializer()
  # No recurrent loop and no micro-batch split in the graph.
  assert not any('Recurrent' in t or 'While' in t for t in op_types), op_types
  with lib.Session(g, 1) as sess:
    sess.run(init)
    a, b = sess.run([out, seq])
  np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize('name', ['gpipe', 'layers_with_gpipe'])
def test_drop_in_keeps_every_public_name_of_lingvos_module(name):
  # Code written against lingvo.core.<name> runs with only the import
  # changed: every public name Lingvo's module has, ours has too.
  import importlib  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top

  def Public(module):
    return {n for n in dir(module) if not n.startswith('_') and
            not isinstance(getattr(module, n), types.ModuleType)}

  theirs = importlib.import_module('lingvo.core.' + name)
  ours = importlib.import_module('lingvo_ext.core.' + name)
  assert sorted(Public(theirs) - Public(ours)) == []
