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


import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import layers
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import schedules
from tests.support import gpipe_testlib as lib

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


def RandomCase(seed, widths=(2, 6), batches=(4, 8, 12)):
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
  variants = ALL_VARIANTS + _ListVariants(RandomCase(seed)[-1])
  return tuple(v for i, v in enumerate(variants)
               if ((i + seed + 1) % 4 == 0) == (part == 'quick'))


@pytest.mark.parametrize('seed,part', [(s, 'quick') for s in range(10)] + [
    pytest.param(s, 'rest', marks=pytest.mark.slow) for s in range(10)])
def test_random_pipelines_match_sequential(seed, part):
  cells, num_devices, inputs_fn, loss_fn, kwargs, desc = RandomCase(seed)
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
  cells, num_devices, inputs_fn, loss_fn, kwargs, desc = RandomCase(seed)
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
  cells, num_devices, inputs_fn, _, kwargs, desc = RandomCase(
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
  descs = [RandomCase(s)[-1] for s in range(10)]
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
