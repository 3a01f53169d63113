"""Every schedule equals the sequential model for every structure Lingvo takes.

Two kinds of cases:

- Lingvo's own `gpipe_test` structure, written anew here: 16 conv layers with
  an accumulator each, the first cell ending in a `FetchLayer` whose
  activation later cells pass through (`act_fetch_layers`, `num_act_inputs`,
  `num_act_outputs`), with Lingvo's golden gradient norm.
- Random pipelines from a seeded generator: random cells (FC layers of
  random widths, fetched activations at random places, passed through the
  later cells), random `before_tpl`, `batch_dim`, micro-batching by
  `num_micro_batches` or `micro_batch_size`, and a loss on a random subset of
  the outputs, linear or not. Every schedule and recompute variant must give
  the sequential model's outputs and gradients.
"""

import gc
import re
import weakref

import lingvo_ext  # pylint: disable=unused-import
import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import layers
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.core import schedules
from tests.support import gpipe_testlib as lib
from tests.core import test_gpipe
from tests.core import test_schedules


# Cells built inline, a copy per micro-batch (cell functions are the default).
_INLINE = (('cell_functions', False),)
INLINE_VARIANTS = (('unrolled', False, _INLINE), ('unrolled', True, _INLINE),
                   ('1f1b', None, _INLINE), ('1f1b', True, _INLINE))
# XLA-compiled cell functions (jit_compile): the same numbers, faster.
_JIT = (('cell_functions', True), ('jit_compile', True))
JIT_VARIANTS = (('unrolled', False, _JIT), ('unrolled', True, _JIT),
                ('1f1b', None, _JIT), ('1f1b', True, _JIT))
ALL_VARIANTS = (lib.VARIANTS + (('1f1b', True),) + INLINE_VARIANTS +
                JIT_VARIANTS)


# --- Lingvo's DummyPipelineCnn structure --------------------------------------


class _StepCounter(base_layer.Accumulator):
  """Counts the times a layer ran (one per micro-batch in a pipeline)."""

  def DefaultValue(self):
    return tf.convert_to_tensor(0.0)

  def Increment(self):
    self.SetValue(self.GetValue() + 1.0)


class _CountingConv(base_layer.BaseLayer):
  """A 3x3 conv with constant weights, a relu, and a run counter."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild(
        'conv', layers.Conv2DLayerNoPadding.Params().Set(
            name='conv', filter_shape=(3, 3, 1, 1), filter_stride=(1, 1),
            params_init=py_utils.WeightInit.Constant(0.1)))
    self.RegisterAccumulator('ts_count', _StepCounter())

  def FProp(self, theta, inputs):
    out = self.conv.FProp(theta.conv, inputs)
    self.accumulators.ts_count.Increment()
    return tf.nn.relu(out)

  @classmethod
  def FPropMeta(cls, p, inputs):
    return py_utils.NestedMap(flops=1, out_shapes=(inputs,))


def _CnnCells(num_splits, num_layers=16):
  """Lingvo's layout: the first cell ends in a FetchLayer whose activation
  (the same tensor as that cell's main output) every later cell passes on."""
  subs = [_CountingConv.Params().Set(name='layer_%d' % i)
          for i in range(num_layers)]
  if num_splits == 1:
    return [gpipe.FeatureExtractionLayer.Params().Set(name='seq', sub=subs)]
  per = num_layers // num_splits
  cells = []
  for s in range(num_splits):
    sub = subs[s * per:(s + 1) * per]
    if s == 0:
      sub.append(layers.FetchLayer.Params().Set(name='fetch'))
      kw = dict(act_fetch_layers=['fetch'], num_act_outputs=1)
    else:
      kw = dict(num_act_inputs=1, num_act_outputs=1)
    cells.append(gpipe.FeatureExtractionLayer.Params().Set(
        name='split_%d' % s, sub=sub, **kw))
  return cells


_CNN_INPUT = []


def _CnnInput():
  """Lingvo's test input: its graph and op seeds, so its golden value holds."""
  if not _CNN_INPUT:
    with tf.Graph().as_default():
      tf.random.set_seed(1245)
      x = tf.random.uniform([16, 8, 8, 1], seed=12345)
      with tf.Session() as sess:
        _CNN_INPUT.append(sess.run(x))
  return tf.constant(_CNN_INPUT[0])


# Lingvo's golden test under the default schedule, cells built once, 1F1B and
# Lingvo's loop; the random pipelines below cover every variant. One test
# per (case, variant), so that test workers share them. The quick tier runs
# one split, two splits with cells built once (the default), and 2-example
# micro-batches under 1F1B; the others are marked slow (the quick tier's
# accumulator test below runs this CNN under every schedule).
_CNN_VARIANTS = (('unrolled', None), ('unrolled', None, _INLINE), ('1f1b', None),
                 ('recurrent', None))
_CNN_CASES = ((2, 8, None), (4, 8, None), (2, 8, 2))


@pytest.mark.parametrize('num_splits,num_micro,micro_batch_size,variant', [
    (1, 8, None, ('unrolled', None)),
    (4, 8, None, ('zbv', None))] + [
        case + (v,) if i == c != 1 else pytest.param(
            *case, v, marks=pytest.mark.slow)
        for c, case in enumerate(_CNN_CASES)
        for i, v in enumerate(_CNN_VARIANTS)])
def test_lingvo_dummy_pipeline_cnn(num_splits, num_micro, micro_batch_size,
                                   variant):
  # Lingvo's golden value for this model (gpipe_test.py): the loss is the mean
  # of the main output only, so the fetched activation gets no gradient of
  # its own but is the same tensor as cell 0's main output.
  golden = 0.268087
  loss_fn = lambda out: tf.reduce_mean(out[0] if isinstance(out, tuple)
                                       else out)
  num_devices = min(num_splits, 2)
  results, seq, names = lib.RunVariants(
      _CnnCells(num_splits), num_devices, lambda: (_CnnInput(),),
      variants=(variant,), loss_fn=loss_fn,
      num_micro_batches=num_micro, micro_batch_size=micro_batch_size)
  assert len(names) == 16
  seq_norm = np.sqrt(sum(np.sum(g * g) for g in seq[1]))
  np.testing.assert_allclose(seq_norm, golden, rtol=1e-5)
  out, grads = results[variant]
  norm = np.sqrt(sum(np.sum(g * g) for g in grads))
  np.testing.assert_allclose(norm, golden, rtol=1e-5)
  if num_splits > 1:
    assert len(out) == 2 and out[1].shape == (16, 8, 8, 1)
  lib.AssertVariantsMatch(results, seq, names)


# The quick tier runs every schedule once, cell functions once and recompute
# on and off; the further combinations are marked slow.
@pytest.mark.parametrize('schedule,functions,recompute', [
    ('unrolled', False, False), ('1f1b', False, None), ('recurrent', False, None),
    ('unrolled', True, False),
    pytest.param('1f1b', True, None, marks=pytest.mark.slow),
    ('unrolled', False, True),
    pytest.param('1f1b', False, True, marks=pytest.mark.slow),
    pytest.param('unrolled', True, True, marks=pytest.mark.slow),
    ('zero_bubble', False, None), ('interleaved_1f1b', False, None),
    ('zbv', False, None)])
def test_lingvo_dummy_pipeline_cnn_accumulators(schedule, functions, recompute):
  # Each layer's accumulator counts the micro-batches that ran through it,
  # with the backward pass built (a recomputation is no further micro-batch).
  num_micro = 4
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        # 'zbv' places two cells on each device.
        name='pipeline', cell_tpl=_CnnCells(4 if schedule == 'zbv' else 2),
        num_micro_batches=num_micro, schedule=schedule, cell_functions=functions,
        recompute=recompute).Instantiate()
    out = net.FPropDefaultTheta(_CnnInput())
    grads = tf.gradients(tf.reduce_mean(out[0]), net.vars.Flatten())
    counts = net.GetAccumulatorValues().Flatten()
    init = tf.global_variables_initializer()
  with lib.Session(g, 2) as sess:
    sess.run(init)
    values = sess.run([grads, counts])[1]
  assert len(values) == 16
  assert all(v == num_micro for v in values), values


# --- Random pipelines ---------------------------------------------------------


def _RandomCase(seed, widths=(2, 6), batches=(4, 8, 12)):
  """A random pipeline: cells, inputs, PipeliningLayer kwargs, loss.

  Layer widths are drawn from range(*widths), the batch from `batches`.
  """
  rng = np.random.RandomState(seed)
  num_cells = rng.randint(2, 5)
  num_devices = 2 if num_cells < 4 or rng.rand() < 0.5 else 4
  batch = int(rng.choice(batches))
  batch_dim = int(rng.rand() < 0.3)
  width = int(rng.randint(*widths))
  before = []
  if rng.rand() < 0.4:
    new_width = int(rng.randint(*widths))
    before = [lib.Fc('before', width, new_width, seed=seed + 1000)]
    width = new_width
  cells, num_acts, layer_id, fetch_id = [], 0, 0, 0
  for c in range(num_cells):
    subs, fetches = [], []
    for _ in range(rng.randint(1, 4)):
      out_width = int(rng.randint(*widths))
      subs.append(lib.Fc('fc%d' % layer_id, width, out_width,
                         seed=seed * 100 + layer_id))
      layer_id += 1
      width = out_width
      # Fetch an activation (in the last cell too: its output then holds it;
      # at the end of a cell it is the same tensor as the cell's output).
      if rng.rand() < 0.4:
        name = 'fetch%d' % fetch_id
        fetch_id += 1
        subs.append(layers.FetchLayer.Params().Set(name=name))
        fetches.append(name)
    cells.append(gpipe.FeatureExtractionLayer.Params().Set(
        name='cell%d' % c, sub=subs, act_fetch_layers=fetches,
        num_act_inputs=num_acts, num_act_outputs=num_acts + len(fetches)))
    num_acts += len(fetches)
  num_outputs = 1 + num_acts
  # A loss on a random non-empty subset of outputs; linear or not.
  used = [k for k in range(num_outputs) if rng.rand() < 0.6] or [0]
  nonlinear = rng.rand() < 0.4
  weights = [rng.uniform(-1, 1, size=64).astype(np.float32)
             for _ in range(num_outputs)]

  def LossFn(out):
    out = out if isinstance(out, tuple) else (out,)
    assert len(out) == num_outputs
    total = 0.
    for k in used:
      flat = tf.reshape(out[k], [-1])
      w = tf.constant(np.resize(weights[k], flat.shape.as_list()[0]))
      total += tf.reduce_sum((tf.sin(flat) if nonlinear else flat) * w)
    return total

  num_micro = int(rng.choice([m for m in (1, 2, 4) if batch % m == 0]))
  kwargs = dict(num_micro_batches=num_micro, batch_dim=batch_dim,
                before_tpl=before)
  if rng.rand() < 0.3:
    kwargs['micro_batch_size'] = batch // num_micro
  shape = [batch, width_in(before, cells)] if batch_dim == 0 else [
      3, batch, width_in(before, cells)]
  inputs_fn = lambda: (tf.constant(rng_input(seed, shape)),)
  desc = dict(cells=num_cells, devices=num_devices,
              before=bool(before), fetches=fetch_id, used=used,
              nonlinear=nonlinear, **{k: v for k, v in kwargs.items()
                                      if k != 'before_tpl'})
  return cells, num_devices, inputs_fn, LossFn, kwargs, desc


def width_in(before, cells):
  return (before[0] if before else cells[0].sub[0]).input_dim


def rng_input(seed, shape):
  return np.random.RandomState(seed + 7).randn(*shape).astype(np.float32)


def _ListVariants(desc):
  """The action-list schedules that take this case (any loss)."""
  k, d, m = desc['cells'], desc['devices'], desc['num_micro_batches']
  out = []
  # More cells than devices: zero_bubble's schedule folded onto them.
  out += [('zero_bubble', None), ('zero_bubble', None, _INLINE),
          ('zero_bubble', True)]
  if k % d == 0 and m % d == 0:
    # Inline cells with recompute: every variant then lands in some case's
    # quick part (test_random_cases_cover_the_structures).
    out += [('interleaved_1f1b', None), ('interleaved_1f1b', True, _INLINE)]
  return tuple(out)


def _Variants(seed, part):
  """The variants seed's case runs in `part`: 'quick' takes every 4th.

  The quick tier runs every case with its quick part (every variant in at
  least one case; test_random_cases_cover_the_structures checks), the whole
  suite runs the rest too (marked slow).
  """
  variants = ALL_VARIANTS + _ListVariants(_RandomCase(seed)[-1])
  return tuple(v for i, v in enumerate(variants)
               if ((i + seed + 1) % 4 == 0) == (part == 'quick'))


@pytest.mark.parametrize('seed,part', [(s, 'quick') for s in range(10)] + [
    pytest.param(s, 'rest', marks=pytest.mark.slow) for s in range(10)])
def test_random_pipelines_match_sequential(seed, part):
  cells, num_devices, inputs_fn, loss_fn, kwargs, desc = _RandomCase(seed)
  variants = _Variants(seed, part)
  results, seq, names = lib.RunVariants(
      cells, num_devices, inputs_fn, variants=variants, loss_fn=loss_fn,
      **kwargs)
  assert set(results) == set(variants), desc
  try:
    lib.AssertVariantsMatch(results, seq, names)
  except AssertionError as e:
    raise AssertionError('%s\n%s' % (desc, e)) from None


# ZB-V places two cells on each device: the random cases with an even number
# of cells, at least twice the devices (4 cells on 2 devices).
@pytest.mark.parametrize('seed', [3, 9])
def test_random_pipelines_match_sequential_under_zbv(seed):
  cells, num_devices, inputs_fn, loss_fn, kwargs, desc = _RandomCase(seed)
  assert len(cells) % 2 == 0 and 2 * num_devices <= len(cells), desc
  variants = (('zbv', None), ('zbv', True, _INLINE))
  results, seq, names = lib.RunVariants(
      cells, num_devices, inputs_fn, variants=variants, loss_fn=loss_fn,
      **kwargs)
  assert set(results) == set(variants), desc
  try:
    lib.AssertVariantsMatch(results, seq, names)
  except AssertionError as e:
    raise AssertionError('%s\n%s' % (desc, e)) from None


@pytest.mark.parametrize('seed', [0, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(2, marks=pytest.mark.slow)])
def test_random_wide_pipelines_take_1f1b_runs_longer_than_k(seed,
                                                            monkeypatch):
  # Random pipelines whose weights outweigh their micro-batches' MatMul
  # operands (widths 24-32, one row per micro-batch, M = 8, a loss linear in
  # the outputs): '1f1b' with cell functions computes each cell's weight
  # gradients in runs longer than K (schedules.WeightGradientRunLength) and
  # still equals the sequential model.
  cells, num_devices, inputs_fn, _, kwargs, desc = _RandomCase(
      seed, widths=(24, 33), batches=(8,))
  kwargs['num_micro_batches'] = 8
  if 'micro_batch_size' in kwargs:
    kwargs['micro_batch_size'] = 1
  runs = []
  sized = schedules.Interpreter._WeightGradientRun  # pylint: disable=protected-access
  monkeypatch.setattr(schedules.Interpreter, '_WeightGradientRun',  # pylint: disable=protected-access
                      lambda self: runs.append(sized(self)) or runs[-1])
  results, seq, names = lib.RunVariants(
      cells, num_devices, inputs_fn, variants=[('1f1b', None)], **kwargs)
  assert runs and all(r > len(cells) for r in runs), (desc, runs)
  # 1e-4: float32 round-off at these widths; with oneDNN off seed 2's
  # gradients differ from the sequential model's by 4.1e-5 under 'unrolled'
  # and 'recurrent' too (4.05e-5 under '1f1b').
  lib.AssertVariantsMatch(results, seq, names, atol=1e-4)


def test_random_cases_cover_the_structures():
  """The generator reaches every structure it is meant to (not only FC)."""
  descs = [_RandomCase(s)[-1] for s in range(10)]
  assert any(d['fetches'] for d in descs)
  assert any(d['batch_dim'] == 1 for d in descs)
  assert any(d['before'] for d in descs)
  assert any(d['nonlinear'] for d in descs)
  assert any('micro_batch_size' in d for d in descs)
  assert any(d['num_micro_batches'] > 1 for d in descs)
  assert any(d['devices'] == 4 for d in descs)
  assert any(len(d['used']) < 1 + d['fetches'] for d in descs)
  lists = [v[0] for d in descs for v in _ListVariants(d)]
  assert 'zero_bubble' in lists and 'interleaved_1f1b' in lists
  # Each case runs every variant it takes, split in two parts; the quick
  # tier's parts cover every variant, and every case runs in it.
  every = set(ALL_VARIANTS) | {v for d in descs for v in _ListVariants(d)}
  quick = [_Variants(s, 'quick') for s in range(10)]
  assert all(quick) and set(sum(quick, ())) == every
  for s in range(10):
    both = _Variants(s, 'quick') + _Variants(s, 'rest')
    assert sorted(both, key=str) == sorted(
        ALL_VARIANTS + _ListVariants(descs[s]), key=str)


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


def test_cell_functions_batch_broadcast_weight_gradients():
  # A weight broadcast over a BatchMatMul's leading dimensions (run as a
  # 2-D MatMul, gemm_rewrite): its gradient is also computed once, outside
  # the function, from [B*T, D] rows; equal to the sequential model's and
  # inline cells'.
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_ProjectionCells(),
        num_micro_batches=4).Instantiate()
    out = net.FPropDefaultTheta(*_Input3D())
    tf.gradients(tf.reduce_sum(out * out), net.vars.Flatten())
  graph_def = g.as_graph_def()
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


# --- Schedules run from their action lists -----------------------------------


def _ListGraph(schedule, num_cells, num_devices, num_micro, loss='sum'):
  cells = [gpipe.FeatureExtractionLayer.Params().Set(
      name='cell%d' % c, sub=[lib.Fc('fc%d' % c, 6, 6, seed=c + 1)])
           for c in range(num_cells)]
  g = tf.Graph()
  with g.as_default(), lib.Cluster(num_devices):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=num_micro,
        schedule=schedule).Instantiate()
    out = net.FPropDefaultTheta(tf.ones([4 * num_micro, 6]))
    loss_value = tf.reduce_sum(out if loss == 'sum' else out * out)
    tf.gradients(loss_value, net.vars.Flatten())
  return g


@pytest.mark.parametrize('schedule,num_cells,num_devices,num_micro', [
    ('zero_bubble', 2, 2, 4), ('zero_bubble', 3, 3, 5),
    ('zero_bubble', 4, 2, 3), ('interleaved_1f1b', 4, 2, 4)])
def test_each_device_runs_its_action_list_in_order(schedule, num_cells,
                                                   num_devices, num_micro):
  g = _ListGraph(schedule, num_cells, num_devices, num_micro)
  spec = schedules.StageSpec(num_cells, num_devices, num_micro)
  _AssertGatesFollow(g, schedules.Build(schedule, spec))


def _AssertGatesFollow(g, schedule):
  """Each action's gate in `g` waits for the action before it on its device."""
  gate_names = {'F': 'fwd_gate', 'B': 'bwd_gate', 'I': 'bwd_gate',
                'W': 'weight_grad/w_gate'}

  def Gate(a):
    suffix = 'cell%d_mb%d/%s' % (a.stage, a.micro_batch, gate_names[a.kind])
    found = [op for op in g.get_operations() if op.name.endswith(suffix)]
    assert len(found) == 1, (a, [op.name for op in found])
    return found[0]

  for device_actions in schedule:
    for prev, a in zip(device_actions, device_actions[1:]):
      assert Gate(prev) in test_schedules._Ancestors(Gate(a), {}), (prev, a)  # pylint: disable=protected-access


def test_list_schedules_run_forwards_first_for_a_nonlinear_loss():
  # The output gradient needs every forward pass: each device's gates follow
  # schedules.ForwardsFirst of the schedule (the linear case is tested above).
  for schedule, num_cells in (('zero_bubble', 2), ('interleaved_1f1b', 4)):
    g = _ListGraph(schedule, num_cells, 2, 4, loss='square')
    spec = schedules.StageSpec(num_cells, 2, 4)
    order = schedules.ForwardsFirst(schedules.Build(schedule, spec))
    assert order != schedules.Build(schedule, spec)
    _AssertGatesFollow(g, order)


def test_list_schedules_refuse_what_they_cannot_run():
  with pytest.raises(ValueError, match='num_micro_batches=3 must be a '
                     'multiple of the number of devices'):
    _ListGraph('interleaved_1f1b', 4, 2, 3)
