"""Cells built once (pipeline/cell_function.py): a cell is a TF function
built once and called per micro-batch; its graph grows with call sites, not
cell copies; weight gradients batch across micro-batches; sparse lookups stay
sparse; a dropped graph is freed; XLA-compiled cells match the sequential
model."""

import gc
import re
import weakref

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import layers
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from tests.core import test_gpipe
from tests.support import gpipe_testlib as lib

# Cells built inline, a copy per micro-batch (cell functions are the default).
_INLINE = (('cell_functions', False),)


# --- Cells built once ---------------------------------------------------------


def _GraphSize(num_micro, functions, schedule='unrolled', jit=False):
  """(ops in the graph, per-cell forward call ops) of a 2-cell FC pipeline."""
  cells = test_gpipe._FcCells(2, 3)  # pylint: disable=protected-access
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=num_micro,
        schedule=schedule, cell_functions=functions,
        jit_compile=jit).Instantiate()
    out = net.FPropDefaultTheta(tf.ones([8 * num_micro, 6]))
    tf.gradients(tf.reduce_sum(out), net.vars.Flatten())
  calls = [op for op in g.get_operations()
           if op.type in ('PartitionedCall', 'StatefulPartitionedCall')]
  return len(g.get_operations()), calls


@pytest.mark.parametrize('schedule', ['unrolled', '1f1b'])
def test_cell_functions_graph_grows_with_call_sites_not_cell_copies(schedule):
  # Inline, every micro-batch copies every cell's ops (forward and
  # backward); with cell functions a micro-batch adds a few call sites.
  inline = [_GraphSize(m, False, schedule)[0] for m in (2, 8)]
  fn = [_GraphSize(m, True, schedule)[0] for m in (2, 8)]
  per_micro_inline = (inline[1] - inline[0]) / 6
  per_micro_fn = (fn[1] - fn[0]) / 6
  assert per_micro_fn < per_micro_inline / 2, (inline, fn)
  # Forward and backward of each cell, one call each per micro-batch.
  _, calls = _GraphSize(8, True, schedule)
  fwd = [op for op in calls if re.search(r'cell\d_mb\d+/', op.name) and
         not op.name.startswith('gradients')]
  assert len(fwd) == 2 * 8, [op.name for op in calls]
  # Every call, forward and backward, carries a config under which the
  # runtime does not optimize the function again per call site.
  assert len(calls) == 2 * 2 * 8
  for op in calls:
    config = tf.config_pb2.ConfigProto.FromString(op.get_attr('config_proto'))
    assert config.graph_options.rewrite_options.disable_meta_optimizer, op.name


def test_a_pipeline_called_twice_calls_each_cell_function_traced_once():
  # FProps of one pipeline in one graph ('unrolled', a float64 micro-batch
  # step, '1f1b' on the same cells and input, then a batch of another shape)
  # call one traced function per cell and signature, and each equals the
  # sequential model.
  cells = test_gpipe._FcCells(2, 3)  # pylint: disable=protected-access
  rng = np.random.RandomState(0)
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=2).Instantiate()
    x = tf.constant(rng.uniform(-1, 1, [8, 6]).astype(np.float32))
    y = tf.constant(rng.uniform(-1, 1, [4, 6]).astype(np.float32))
    calls = [('x0', net, x), ('z0', lib.Variant(net, 'unrolled', None, (
        ('state_dtype', tf.float64),)), x),
             ('x1', lib.Variant(net, '1f1b', None), x), ('y0', net, y)]
    variables = net.vars.Flatten()
    pipe, seq = [], []
    for name, layer, inp in calls:
      with tf.name_scope(name):
        w = tf.constant(rng.uniform(-1, 1, [int(inp.shape[0]), 6]).astype(
            np.float32))
        for model, out in ((pipe, layer.FProp(net.theta, inp)),
                           (seq, net.FPropSequential(net.theta, inp))):
          model.append([out] + tf.gradients(tf.reduce_sum(out * w), variables))
    init = tf.global_variables_initializer()
  fns = {}  # (call, cell) -> the functions its forward calls call.
  for op in g.get_operations():
    m = re.match(r'(\w\d)/(cell\d)_mb\d/', op.name)
    if m and op.type in ('PartitionedCall', 'StatefulPartitionedCall'):
      fns.setdefault(m.groups(), set()).add(op.get_attr('f').name)
  assert sorted(fns) == [(n, c) for n in ('x0', 'x1', 'y0', 'z0')
                         for c in ('cell0', 'cell1')], fns
  for c in ('cell0', 'cell1'):
    assert len(fns['x0', c]) == 1 and fns['x0', c] == fns['x1', c], fns
    # Another batch shape, another micro-batch step dtype: other traces.
    for other in ('y0', 'z0'):
      assert len(fns[other, c]) == 1 and fns[other, c] != fns['x0', c], fns
  with lib.Session(g, 2) as sess:
    sess.run(init)
    pipe, seq = sess.run([pipe, seq])
  for p_out, s_out in zip(pipe, seq):
    lib.AssertAllClose(p_out, s_out)


def test_cell_functions_batch_weight_gradients_across_micro_batches():
  # A cell function's backward pass computes no weight gradient: each weight
  # MatMul exports its operands, and the engine computes x^T dy once over all
  # micro-batches' rows (one MatMul per weight, not one per micro-batch).
  _, calls = _GraphSize(4, True)

  def WeightGradMatMuls(nodes):
    return [n for n in nodes if n.op == 'MatMul' and n.attr['transpose_a'].b]
  graph_def = calls[0].graph.as_graph_def()
  in_functions = [n for f in graph_def.library.function
                  for n in WeightGradMatMuls(f.node_def)]
  assert not in_functions, [n.name for n in in_functions]
  outer = WeightGradMatMuls(graph_def.node)
  assert len(outer) == 2 * 3, [n.name for n in outer]  # 2 cells x 3 FC.
  assert all('weight_grad' in n.name for n in outer), [n.name for n in outer]


def _ProjectionCells():
  """2 cells of Lingvo ProjectionLayers: [B, T, D] @ [D, D] BatchMatMuls."""
  return [gpipe.FeatureExtractionLayer.Params().Set(
      name='cell%d' % c,
      sub=[layers.ProjectionLayer.Params().Set(
          name='proj%d_%d' % (c, j), input_dim=6, output_dim=6,
          activation='TANH', batch_norm=False, has_bias=True,
          params_init=py_utils.WeightInit.Gaussian(0.5, seed=c * 10 + j))
           for j in range(2)]) for c in range(2)]


def _Input3D():
  return (tf.constant(
      np.random.RandomState(0).randn(8, 3, 6).astype(np.float32)),)


def _ProjectionGraphDef(**kwargs):
  """The GraphDef of _ProjectionCells' pipeline (M=4) and its gradients."""
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_ProjectionCells(), num_micro_batches=4,
        **kwargs).Instantiate()
    out = net.FPropDefaultTheta(*_Input3D())
    tf.gradients(tf.reduce_sum(out * out), net.vars.Flatten())
  return g.as_graph_def()


def test_cell_functions_batch_broadcast_weight_gradients():
  # A weight broadcast over a BatchMatMul's leading dimensions (run as a
  # 2-D MatMul, gemm_rewrite): its gradient is also computed once, outside
  # the function, from [B*T, D] rows; equal to the sequential model's and
  # inline cells'.
  graph_def = _ProjectionGraphDef()
  body = [n for f in graph_def.library.function for n in f.node_def]
  # Forward and dx as 2-D MatMuls (gemm_rewrite); the BatchMatMuls they
  # replace are left unread (pruned when the function runs).
  assert sum(n.op == 'MatMul' for n in body) >= 8
  for f in graph_def.library.function:
    read = {i.lstrip('^').split(':')[0] for n in f.node_def for i in n.input}
    assert not [n.name for n in f.node_def
                if n.op == 'BatchMatMulV2' and n.name in read]
  assert not [n.name for n in body if n.op == 'BatchMatMulV2' and
              n.attr['adj_x'].b], 'a weight gradient inside a function'
  outer = [n for n in graph_def.node
           if n.op == 'MatMul' and n.attr['transpose_a'].b]
  assert len(outer) == 4, [n.name for n in outer]  # One per weight.
  results, seq, names = lib.RunVariants(
      _ProjectionCells(), 2, _Input3D, num_micro_batches=4,
      variants=(('unrolled', False), ('1f1b', None), ('zero_bubble', None),
                ('unrolled', False, _INLINE)))
  lib.AssertVariantsMatch(results, seq, names)


def _Run(fdef):
  """The nodes of a FunctionDef its outputs depend on (what a call runs:
  the runtime prunes the rest, e.g. a gradient tf.gradients built and
  dropped)."""
  nodes = {n.name: n for n in fdef.node_def}
  stack = [v.split(':')[0] for v in fdef.ret.values()]
  stack += list(fdef.control_ret.values())
  seen = set()
  while stack:
    name = stack.pop()
    if name in seen or name not in nodes:
      continue
    seen.add(name)
    stack += [i.lstrip('^').split(':')[0] for i in nodes[name].input]
  return [nodes[k] for k in sorted(seen)]


@pytest.mark.parametrize('flat', [True, False])
def test_cell_functions_batch_bias_gradients_across_micro_batches(flat):
  # A bias added to a weight MatMul's product shares the product's dy: the
  # backward functions sum none per micro-batch (no Sum in any function;
  # inline cells' backward sums each bias once per micro-batch), the engine
  # sums each bias's dy once over all micro-batches' rows, a [1, rows] x
  # [rows, out] GEMM per bias; the gradients equal the sequential model's
  # (the test above, and the randomized structures' of
  # test_pipeline_structures.py).
  graph_def = _ProjectionGraphDef(flat_weight_matmuls=flat)
  body = [n for f in graph_def.library.function for n in _Run(f)]
  assert not [n.name for n in body if n.op == 'Sum']
  outer = [n for n in graph_def.node if n.op == 'MatMul' and
           'weight_grad' in n.name and not n.attr['transpose_a'].b]
  assert len(outer) == 4, [n.name for n in outer]  # One per bias.
  inline = _ProjectionGraphDef(flat_weight_matmuls=flat, cell_functions=False)
  assert sum(n.op == 'Sum' for n in inline.node) >= 4 * 4


class _EmbedAndScore(base_layer.BaseLayer):
  """ids [B, T] -> [B, T, D]: an embedding, and a table used three ways.

  `emb` is only looked up: its gradient is sparse. `w` is looked up, then
  multiplied as x w^T (an adjoint MatMul, differentiated in the function)
  and as s w (exported): its gradient sums sparse rows and two dense parts.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 7, 'Rows of both tables.')
    p.Define('dim', 4, 'Columns of both tables.')
    return p

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    p = self.params
    for name, seed in (('emb', 1), ('w', 2)):
      self.CreateVariable(name, py_utils.WeightParams(
          [p.vocab_size, p.dim], py_utils.WeightInit.Gaussian(0.5, seed=seed)))

  def FProp(self, theta, ids):
    p = self.params
    ids = tf.cast(ids, tf.int32)
    e = tf.gather(theta.w, ids)
    s = tf.matmul(tf.reshape(e, [-1, p.dim]), theta.w, transpose_b=True)
    scored = tf.reshape(tf.matmul(tf.tanh(s), theta.w), [-1, 3, p.dim])
    return tf.nn.embedding_lookup(theta.emb, ids) + e + 0.1 * scored

  @classmethod
  def FPropMeta(cls, p, ids):
    return py_utils.NestedMap(
        flops=1, out_shapes=(lib.Shape(ids[0], ids[1], p.dim),))


def _LookupCells():
  """Cell 0 looks up rows of weights; cell 1 projects [B, 3, 4]."""
  return [_EmbedAndScore.Params().Set(name='cell0'),
          gpipe.FeatureExtractionLayer.Params().Set(
              name='cell1', sub=[layers.ProjectionLayer.Params().Set(
                  name='proj', input_dim=4, output_dim=4, activation='TANH',
                  batch_norm=False, has_bias=True,
                  params_init=py_utils.WeightInit.Gaussian(0.5, seed=5))])]


@pytest.mark.parametrize('schedule,recompute,functions', [
    ('unrolled', False, True), ('unrolled', True, True), ('1f1b', None, True),
    ('1f1b', True, True), ('zero_bubble', None, True),
    ('unrolled', False, False), ('recurrent', True, False)])
def test_cell_functions_keep_lookup_gradients_sparse(schedule, recompute,
                                                     functions):
  # A cell that looks up rows of its weights is built once too: each lookup
  # exports its ids and the gradient of its output, so the weight's gradient
  # is built outside the function as IndexedSlices, as inline (a function
  # would return it dense, vocabulary-sized per micro-batch), and summed
  # with the weight's dense gradients where it has some.
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_LookupCells(), num_micro_batches=4,
        schedule=schedule, recompute=recompute,
        cell_functions=functions).Instantiate()
    ids = tf.constant(np.random.RandomState(0).randint(0, 7, [8, 3]),
                      tf.float32)
    out = net.FPropDefaultTheta(ids)
    seq_out = net.FPropSequential(net.theta, ids)
    variables = net.vars.Flatten()
    loss = lambda o: tf.reduce_sum(o * o)
    grads = tf.gradients(loss(out), variables,
                         colocate_gradients_with_ops=True)
    seq_grads = tf.gradients(loss(seq_out), variables)
  names = [v.op.name for v in variables]
  sparse = dict(zip(names, [isinstance(x, tf.IndexedSlices) for x in grads]))
  if schedule != 'recurrent':  # Lingvo's loop returns it dense.
    assert sparse['cell0/emb/var'] and not sparse['cell0/w/var'], sparse
  calls = [op.name for op in g.get_operations() if op.type in (
      'PartitionedCall', 'StatefulPartitionedCall') and
           op.name.startswith('cell0_mb')]
  fn_cells = functions and schedule != 'recurrent'
  assert bool(calls) == fn_cells, calls
  if fn_cells:  # No vocabulary-sized gradient per micro-batch.
    body = [n for f in g.as_graph_def().library.function for n in f.node_def]
    assert not [n.name for n in body if n.op == 'UnsortedSegmentSum'], body
  with g.as_default():
    dense = [tf.convert_to_tensor(x) for x in grads + seq_grads]
    init = tf.global_variables_initializer()
  with lib.Session(g, 2) as sess:
    sess.run(init)
    res = sess.run([out, seq_out] + dense)
  lib.AssertAllClose(res[0], res[1])
  n = len(variables)
  for name, a, b in zip(names, res[2:2 + n], res[2 + n:]):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)


class _ColumnLookup(base_layer.BaseLayer):
  """x [B, 4] -> x + columns of w [4, 7] picked by ids: not a row lookup."""

  def _CreateLayerVariables(self):
    super()._CreateLayerVariables()
    self.CreateVariable('w', py_utils.WeightParams(
        [4, 7], py_utils.WeightInit.Gaussian(0.5, seed=4)))

  def FProp(self, theta, x):
    return x + tf.reduce_sum(tf.gather(theta.w, [1, 3, 3, 6], axis=1), 1)

  @classmethod
  def FPropMeta(cls, p, x):
    return py_utils.NestedMap(flops=1, out_shapes=(x,))


def test_cell_gathering_other_than_rows_is_built_inline():
  # A gather along another axis is not exported: its cell is built inline
  # (its gradient stays TensorFlow's own), the other cell once.
  cells = [_ColumnLookup.Params().Set(name='cell0'),
           gpipe.FeatureExtractionLayer.Params().Set(
               name='cell1', sub=[lib.Fc('fc1', 4, 4, seed=2)])]
  inputs = lambda: (tf.constant(
      np.random.RandomState(0).randn(8, 4).astype(np.float32)),)
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=4).Instantiate()
    net.FPropDefaultTheta(*inputs())
  calls = {op.name.split('_mb')[0] for op in g.get_operations()
           if op.type in ('PartitionedCall', 'StatefulPartitionedCall')}
  assert calls == {'cell1'}, calls
  results, seq, names = lib.RunVariants(
      cells, 2, inputs, num_micro_batches=4,
      variants=(('unrolled', False), ('1f1b', None), ('zero_bubble', None)))
  lib.AssertVariantsMatch(results, seq, names)


@pytest.mark.parametrize('schedule,functions', [
    ('unrolled', True), ('unrolled', False), ('1f1b', True),
    ('zero_bubble', True)])
def test_a_dropped_graph_is_freed(schedule, functions):
  # The engine's per-graph state (backward functions, exported operands)
  # lives on the graph: a registry holding the graph's tensors kept every
  # graph a process built alive.
  def Build():
    g = tf.Graph()
    cells = [gpipe.FeatureExtractionLayer.Params().Set(
        name='cell%d' % c, sub=[lib.Fc('fc%d' % c, 6, 6, seed=c + 1)])
             for c in range(2)]
    with g.as_default(), lib.Cluster(2):
      py_utils.GetOrCreateGlobalStepVar()
      net = gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=cells, num_micro_batches=4,
          schedule=schedule, cell_functions=functions).Instantiate()
      out = net.FPropDefaultTheta(tf.ones([8, 6]))
      tf.gradients(tf.reduce_sum(out * out), net.vars.Flatten())
    return weakref.ref(g)

  ref = Build()
  gc.collect()
  assert ref() is None


def test_jit_compiled_cells_match_sequential():
  cells = [gpipe.FeatureExtractionLayer.Params().Set(
      name='cell%d' % c,
      sub=[lib.Fc('fc%d' % c, 6, 6, seed=c + 1)]) for c in range(2)]
  jit = (('cell_functions', True), ('jit_compile', True))
  variants = (('unrolled', False, jit), ('1f1b', None, jit))
  results, seq, names = lib.RunVariants(
      cells, 2, lambda: (tf.constant(
          np.random.RandomState(0).randn(8, 6).astype(np.float32)),),
      variants=variants, num_micro_batches=4)
  lib.AssertVariantsMatch(results, seq, names, atol=1e-4)
