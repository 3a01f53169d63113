"""bfloat16 through the pipeline: Lingvo's fprop_dtype, float32 variables.

Tolerances: bfloat16 keeps 8 significant bits (relative spacing 2**-8 =
0.0039). The pipeline and the sequential model run the same bfloat16 ops on
other batch splits (micro-batches, their gradients summed in other orders),
so they may differ by a few units in the last place of each value: outputs
and gradients are compared at rtol 3e-2 and atol 3e-2 of the largest value
(float32 tests use 1e-5). Dtypes and bytes are exact.
"""

import os
import sys

from lingvo import model_registry
import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import layers as lingvo_layers
from lingvo.core import py_utils
import numpy as np
import pytest
from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=g-direct-tensorflow-import

from lingvo_ext.core import gpipe
from lingvo_ext.core import precision
from lingvo_ext.pipeline import schedules
from lingvo_ext.tasks import experiment_params
from lingvo_ext.tasks import pipelined_task
import params  # pylint: disable=unused-import
from tests.support import ROOT
from tests.support import gpipe_testlib as lib
from tests.support import zygote

D, B = 32, 16
RTOL = 3e-2
# Every schedule, with and without recomputation where it is allowed, and
# cells built once as TF functions.
VARIANTS = (('unrolled', False), ('unrolled', True), ('1f1b', None),
            ('1f1b', True), ('recurrent', True), ('interleaved_1f1b', None),
            ('zero_bubble', None))
# 'zbv' places two cells on each device: 4 cells (test_bf16_zbv_...).
assert {v[0] for v in VARIANTS} | {'zbv'} == set(schedules.SCHEDULES)
INLINE_VARIANTS = (('unrolled', False), ('1f1b', None))


def _Cells(num_cells, keep_prob=None):
  """FC cells (tanh), each ending in dropout when keep_prob is set."""
  cells = []
  for c in range(num_cells):
    subs = [lib.Fc('fc%d' % c, D, D, seed=c + 1)]
    if keep_prob is not None:
      subs.append(lingvo_layers.DeterministicDropoutLayer.Params().Set(
          name='drop%d' % c, keep_prob=keep_prob))
    cells.append(gpipe.FeatureExtractionLayer.Params().Set(
        name='cell%d' % c, sub=subs))
  return cells


def _LinearLoss(outputs):
  """Per-element weights, linear in the outputs (every schedule takes it)."""
  w = np.random.RandomState(0).uniform(-1, 1, [B, D]).astype(np.float32)
  return tf.reduce_sum(tf.cast(outputs, tf.float32) * w)


def _SequentialPerMicroBatch(net, theta, x, num_micro):
  """The sequential model with the pipeline's per-micro-batch random streams.

  Each cell runs whole on each micro-batch in turn, under the seeds Lingvo's
  pipeline gives micro-batch t (schedules.CellRandomness); autodiff does the
  backward pass. With no random op it is FPropSequential on the batch.
  """
  # pylint: disable=protected-access
  steps = net.MicroBatchSteps(num_micro, tf.float32)
  outs = []
  for t, xt in enumerate(tf.split(x, num_micro)):
    for name, cell in net._cells:
      with schedules.CellRandomness(steps[t], '%s_mb%d' % (name, t)):
        xt = cell.FProp(theta[name], xt)
    outs.append(xt)
  # pylint: enable=protected-access
  return tf.concat(outs, 0)


def _Run(keep_prob, variants, num_micro=4, num_cells=2, **kwargs):
  """bf16 outputs and float32 variable gradients of each variant + reference."""
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    tf.random.set_seed(1)
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_Cells(num_cells, keep_prob),
        num_micro_batches=num_micro,
        fprop_dtype=tf.bfloat16, state_dtype=tf.float32, **kwargs).Instantiate()
    x = tf.constant(np.random.RandomState(1).randn(B, D), tf.bfloat16)
    variables = net.vars.Flatten()
    assert all(v.dtype.base_dtype == tf.float32 for v in variables)
    fetches = {}
    for variant in variants:
      out = lib.Variant(net, *variant).FProp(net.theta, x)
      assert out.dtype == tf.bfloat16, variant
      grads = tf.gradients(_LinearLoss(out), variables,
                           colocate_gradients_with_ops=True)
      assert all(gr.dtype == tf.float32 for gr in grads), variant
      fetches[variant] = (out, grads)
    if keep_prob is None:
      ref = net.FPropSequential(net.theta, x)
    else:
      ref = _SequentialPerMicroBatch(net, net.theta, x, num_micro)
    fetches['ref'] = (ref, tf.gradients(_LinearLoss(ref), variables))
    init = tf.global_variables_initializer()
  with lib.Session(g, 2) as sess:
    sess.run(init)
    return sess.run(fetches)


def _AssertClose(a, b, msg):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_allclose(a, b, rtol=RTOL,
                             atol=RTOL * max(np.abs(b).max(), 1e-6),
                             err_msg=msg)


def test_bf16_zbv_equals_bf16_sequential():
  # Dropout on: the same masks as the sequential model's, exactly.
  res = _Run(0.5, (('zbv', None),), num_cells=4)
  ref_out, ref_grads = res.pop('ref')
  out, grads = res[('zbv', None)]
  _AssertClose(out, ref_out, 'zbv')
  np.testing.assert_array_equal(out == 0, ref_out == 0)
  for g, r in zip(grads, ref_grads):
    _AssertClose(g, r, 'zbv')


# Dropout (0.5) in bf16 is the quick tier's in the inline-cells test below
# (the same masks, exactly); every schedule with it is marked slow.
@pytest.mark.parametrize('keep_prob', [
    None, pytest.param(0.5, marks=pytest.mark.slow)])
def test_bf16_pipeline_equals_bf16_sequential_every_schedule(keep_prob):
  res = _Run(keep_prob, VARIANTS)
  ref_out, ref_grads = res.pop('ref')
  if keep_prob is not None:  # Dropout is on: about half the outputs are 0.
    assert 0.3 < (ref_out == 0).mean() < 0.7
  for variant, (out, grads) in res.items():
    _AssertClose(out, ref_out, str(variant))
    if keep_prob is not None:  # The same masks, exactly.
      np.testing.assert_array_equal(out == 0, ref_out == 0, str(variant))
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
      assert np.abs(b).max() > 0
      _AssertClose(a, b, '%s grad %d' % (variant, i))


def test_bf16_inline_cells_equal_sequential():
  # Cells built inline, a copy per micro-batch (functions are the default).
  res = _Run(0.5, INLINE_VARIANTS, cell_functions=False)
  ref_out, ref_grads = res.pop('ref')
  for variant, (out, grads) in res.items():
    _AssertClose(out, ref_out, str(variant))
    np.testing.assert_array_equal(out == 0, ref_out == 0, str(variant))
    for a, b in zip(grads, ref_grads):
      _AssertClose(a, b, str(variant))


def _BoundaryBytes(variant, dtype, cell_functions=True):
  """(bytes, {dtype: bytes}) between the 2 cells' devices of a train graph."""
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_Cells(2), num_micro_batches=4,
        schedule=variant[0], recompute=variant[1], fprop_dtype=dtype,
        state_dtype=tf.float32, cell_functions=cell_functions).Instantiate()
    x = tf.constant(np.random.RandomState(1).randn(B, D), dtype)
    out = net.FPropDefaultTheta(x)
    tf.gradients(_LinearLoss(out), net.vars.Flatten(),
                 colocate_gradients_with_ops=True)
  return precision.CrossDeviceBytes(g)


@pytest.mark.parametrize('variant', VARIANTS + (('unrolled', 'inline'),))
def test_bytes_between_cells_are_bf16_and_half(variant):
  functions = variant[1] != 'inline'
  if not functions:
    variant = (variant[0], False)
  f32, f32_by = _BoundaryBytes(variant, tf.float32, functions)
  bf16, bf16_by = _BoundaryBytes(variant, tf.bfloat16, functions)
  # Everything that crosses is bfloat16 (activations forward, their
  # gradients backward), and exactly half float32's bytes.
  assert set(f32_by) == {'float32'}, f32_by
  assert set(bf16_by) == {'bfloat16'}, bf16_by
  assert bf16 * 2 == f32
  # 'recurrent''s loop sends its states, not just these.
  if variant[0] != 'recurrent':
    # Exactly the activations (B x D over the micro-batches), each way.
    assert f32 == 2 * B * D * 4


def _Params(model):
  """The registered experiment's training params (flags at defaults)."""
  if not tf.flags.FLAGS.is_parsed():
    tf.flags.FLAGS.mark_as_parsed()
  return model_registry.GetParams(model, 'Train').Copy()


def test_fprop_dtype_override_syntax_and_errors():
  for text in ('bfloat16', 'tf.bfloat16', '"bfloat16"'):
    mp = _Params('lm.TransformerLmTinyGPipe')
    experiment_params.ApplyOverrides(mp, 'task.fprop_dtype:' + text)
    mp.task.cls.CheckParams(mp.task)
    assert precision.ParseDtype(mp.task.fprop_dtype) == tf.bfloat16, text
  assert precision.ParseDtype('float32') == tf.float32
  assert precision.ParseDtype(None) is None
  mp = _Params('lm.TransformerLmTinyGPipe')
  experiment_params.ApplyOverrides(mp, 'task.fprop_dtype:float16')
  with pytest.raises(ValueError, match=r'task.fprop_dtype=.float16.; use '
                     'bfloat16'):
    mp.task.cls.CheckParams(mp.task)


def test_slow_bf16_warning_only_without_onednn_or_bf16_units(monkeypatch):
  W = precision.SlowBf16Warning  # pylint: disable=invalid-name
  assert W(tf.bfloat16, onednn=True, cpu_bf16=True) is None
  assert W(None, onednn=False, cpu_bf16=False) is None
  assert W('float32', onednn=False, cpu_bf16=False) is None
  msg = W('bfloat16', onednn=False, cpu_bf16=True)
  assert 'TF_ENABLE_ONEDNN_OPTS=1' in msg and '\n' not in msg
  # Without bfloat16 units oneDNN does not help: say so, and how to train
  # in float32.
  for onednn in (False, True):
    msg = W('bfloat16', onednn=onednn, cpu_bf16=False)
    assert 'without bfloat16 units' in msg and '\n' not in msg
    assert "--model_params_override='task.fprop_dtype:float32'" in msg
    assert 'TF_ENABLE_ONEDNN_OPTS=1' not in msg
  assert (W('bfloat16') is None) == (
      precision.OneDnnEnabled() and precision.CpuHasBf16Units() is not False)
  # Units unknown (no /proc/cpuinfo): as with them.
  monkeypatch.setattr(precision, 'CpuHasBf16Units', lambda: None)
  assert W('bfloat16', onednn=True) is None
  assert 'TF_ENABLE_ONEDNN_OPTS=1' in W('bfloat16', onednn=False)


@pytest.mark.parametrize('text,units', [
    ('flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n', True),
    ('flags\t\t: fpu sse avx2 fma\nflags\t\t: fpu sse avx2 fma\n', False),
    ('Features\t: fp asimd sve bf16 i8mm\n', True),
    ('Features\t: fp asimd evtstrm\n', False),
    ('processor\t: 0\n', None)])
def test_cpu_bf16_units_from_cpuinfo(tmp_path, text, units):
  path = tmp_path / 'cpuinfo'
  path.write_text(text)
  assert precision.CpuHasBf16Units(str(path)) is units
  assert precision.CpuHasBf16Units(str(tmp_path / 'missing')) is None


@pytest.mark.parametrize('onednn', [False, True])
def test_bf16_warns_or_turns_the_remapper_off(onednn, monkeypatch, capsys):
  from lingvo_ext.distributed import server  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import trainer_flags  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(precision, '_warned', [])
  monkeypatch.setattr(precision, 'OneDnnEnabled', lambda: onednn)
  monkeypatch.setattr(precision, 'CpuHasBf16Units', lambda: True)
  for dtype in (None, 'float32'):
    assert precision.WarnIfSlow(dtype) is None
    assert precision.RemapperOff(dtype) is False
  assert capsys.readouterr().err == ''
  for _ in range(2):  # Said once.
    precision.WarnIfSlow('bfloat16')
  err = capsys.readouterr().err
  assert precision.RemapperOff('bfloat16') is onednn
  if onednn:
    assert err == ''
  else:
    assert err.count('TF_ENABLE_ONEDNN_OPTS=1') == 1, err
  # The trainer's session configs: the remapper off only where the options
  # say so; Lingvo's own config is left as it is.
  off = rewriter_config_pb2.RewriterConfig.OFF
  lingvo_default = py_utils.SessionConfig().graph_options.rewrite_options
  assert lingvo_default.remapping != off
  for remapping in (True, False):
    o = trainer_flags.Options(num_cpu_devices=2, grappler_remapping=remapping)
    for client in (True, False):
      config = server.SessionConfig(o, client=client)
      assert config.device_count['CPU'] == 2
      assert (config.graph_options.rewrite_options.remapping == off) is (
          not remapping)
  assert py_utils.SessionConfig().graph_options.rewrite_options == (
      lingvo_default)


def test_task_param_is_documented_and_passed_through():
  p = pipelined_task.PipelinedTask.Params()
  doc = p._params['fprop_dtype']._description  # pylint: disable=protected-access
  assert 'bfloat16' in doc


# --- Registered tasks, trained in this process -------------------------------

STEPS = 200


def _TaskGraph(model, dtype, eval_mode=False):
  """The task's train (or eval) graph on 2 CPU devices, as the trainer's."""
  mp = _Params(model)
  if dtype is not None:
    experiment_params.ApplyOverrides(mp, 'task.fprop_dtype:' + dtype)
  mp.task.train.save_interval_seconds = 1e9
  g = tf.Graph()
  cp = lib.Cluster(2).params.Copy()
  if eval_mode:
    # As the trainer's evaler with --num_cpu_devices=2 --worker_split_size=2:
    # the pipeline on 2 devices, forward only.
    cp.job = 'evaler'
    cp.evaler = cp.worker.Copy().Set(replicas=1)
    cp.do_eval = True
  with g.as_default(), cluster_factory.Cluster(cp):
    tf.random.set_seed(1)
    model_obj = mp.Instantiate()
    task = model_obj.GetTask()
    if eval_mode:
      model_obj.ConstructFPropGraph()
      train = None
    else:
      model_obj.ConstructFPropBPropGraph()
      train = task.train_op
    ops = py_utils.NestedMap(
        g=g, task=task, train=train, loss=task.eval_metrics['loss'][0],
        init=tf.global_variables_initializer(), saver=tf.train.Saver(),
        vars=sorted(task.vars.Flatten(), key=lambda v: v.op.name))
  return ops


def _Config():
  return tf.config_pb2.ConfigProto(
      device_count={'CPU': 2}, inter_op_parallelism_threads=2,
      intra_op_parallelism_threads=1)


def _TrainLosses(m, sess, steps):
  losses = []
  for _ in range(steps):
    losses.append(sess.run([m.train, m.loss])[1])
  return losses


def _OpDtypes(g, op_type):
  """The dtypes of `op_type` ops in `g` and in its functions (built cells)."""
  graph_def = g.as_graph_def()
  nodes = list(graph_def.node)
  for f in graph_def.library.function:
    nodes += f.node_def
  return {tf.as_dtype(n.attr['T'].type).name for n in nodes
          if n.op == op_type}


@pytest.mark.e2e
@pytest.mark.parametrize('model,op_type', [
    ('lm.TransformerLmTinyGPipe', 'BatchMatMulV2'),
    ('image.ConvClassifierTinyGPipe', 'Conv2D')])
def test_registered_task_trains_in_bf16_like_float32(model, op_type, tmp_path):
  """200 steps each; bf16's final loss within 5% of float32's.

  The Tiny experiments in 2 cells over 2 micro-batches (their GPipe variants:
  the same model and variables) on 2 CPU devices, the same input batches.
  The final loss is the mean of the last 50 steps': the image experiment's
  batches' losses range from 0.004 to 0.45 there, and the mean of the last
  20 differed by 5.03% between bf16 and float32 with oneDNN on an AVX2 CPU
  (2.0% with it off), that of the last 50 by 0.2%.
  """
  final = {}
  for dtype in (None, 'bfloat16'):
    m = _TaskGraph(model, dtype)
    want = 'bfloat16' if dtype else 'float32'
    assert _OpDtypes(m.g, op_type) == {want}, dtype
    assert _OpDtypes(m.g, 'MatMul') == {want}, dtype
    assert all(v.dtype.base_dtype == tf.float32 for v in m.vars)
    with tf.Session(graph=m.g, config=_Config()) as sess:
      sess.run(m.init)
      losses = _TrainLosses(m, sess, STEPS)
      if dtype:
        m.saver.save(sess, str(tmp_path / 'bf16' / 'ckpt'))
    final[want] = float(np.mean(losses[-50:]))
    assert final[want] < 0.8 * losses[0], (want, losses[0], final[want])
  assert abs(final['bfloat16'] - final['float32']) <= 0.05 * final['float32'], (
      final)


@pytest.mark.e2e
def test_checkpoints_move_between_bf16_and_float32(tmp_path):
  """A bf16 run's checkpoint restores into a float32 run, and back."""
  model = 'lm.TransformerLmTinyGPipe'
  bf16, f32 = _TaskGraph(model, 'bfloat16'), _TaskGraph(model, None)
  assert [v.op.name for v in bf16.vars] == [v.op.name for v in f32.vars]
  config = _Config()
  path = str(tmp_path / 'ckpt')
  with tf.Session(graph=bf16.g, config=config) as sess:
    sess.run(bf16.init)
    _TrainLosses(bf16, sess, 5)
    bf16.saver.save(sess, path + '-bf16')
    bf16_vars = sess.run(bf16.vars)
  with tf.Session(graph=f32.g, config=config) as sess:
    f32.saver.restore(sess, path + '-bf16')  # Strict: every variable.
    for a, b in zip(sess.run(f32.vars), bf16_vars):
      np.testing.assert_array_equal(a, b)
      assert a.dtype == np.float32
    _TrainLosses(f32, sess, 5)
    f32.saver.save(sess, path + '-f32')
    f32_vars = sess.run(f32.vars)
  with tf.Session(graph=bf16.g, config=config) as sess:
    bf16.saver.restore(sess, path + '-f32')
    for a, b in zip(sess.run(bf16.vars), f32_vars):
      np.testing.assert_array_equal(a, b)


def test_evaler_graph_runs_in_the_same_dtype():
  m = _TaskGraph('lm.TransformerLmTinyGPipe', 'bfloat16', eval_mode=True)
  assert m.train is None
  assert _OpDtypes(m.g, 'BatchMatMulV2') == {'bfloat16'}
  assert all(v.dtype.base_dtype == tf.float32 for v in m.vars)
  with tf.Session(graph=m.g, config=_Config()) as sess:
    sess.run(m.init)
    loss = sess.run(m.loss)
  assert 3.5 < loss < 6.0  # About log(128) = 4.85 before training.


@pytest.mark.e2e
def test_trainer_and_evaler_in_bf16(tmp_path):
  """The override on the command line: trainer, then evaler, in bfloat16.

  Conv2D + BiasAdd in bfloat16 through Lingvo's gRPC sessions (see
  precision.RemapperOff), with oneDNN as this machine has it.
  """
  flags = ['--model=image.ConvClassifierTinyGPipe', f'--logdir={tmp_path}',
           '--num_cpu_devices=2', '--worker_split_size=2',
           "--model_params_override=task.fprop_dtype:bfloat16"]
  env = dict(os.environ, PYTHONPATH=ROOT)
  for extra in (['--max_steps=4'], ['--job=evaler_dev']):
    out = zygote.run(
        [sys.executable, '-m', 'lingvo_ext.trainer'] + flags + extra,
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
  assert 'evaler_dev: step 4  accuracy' in out.stdout, out.stdout
  # This machine's warning, if any, once per run.
  warning = precision.SlowBf16Warning('bfloat16')
  if warning is None:
    assert 'warning: task.fprop_dtype' not in out.stderr
  else:
    assert out.stderr.count(warning) == 1, out.stderr[-3000:]
  params_text = (tmp_path / 'train' / 'trainer_params.txt').read_text()
  assert "task.fprop_dtype : 'bfloat16'" in params_text


def test_bench_dtype_tables():
  from bench import pipeline_report  # pylint: disable=g-import-not-at-top
  from bench import transformer as bench_transformer  # pylint: disable=g-import-not-at-top
  from bench import transformer_report  # pylint: disable=g-import-not-at-top
  assert bench_transformer.ParseDtypes('float32, bfloat16') == [
      'float32', 'bfloat16']
  with pytest.raises(Exception, match='float16'):
    bench_transformer.ParseDtypes('float16')
  common = dict(model='homogeneous', K=2, M=4, impl='lingvo_ext', onednn=True)
  rows = pipeline_report.MarkdownDtypes([
      dict(common, dtype='float32', step_ms=100.0, bytes_between_cells=8),
      dict(common, dtype='bfloat16', step_ms=62.0, bytes_between_cells=4,
           vs_float32=0.62, first_loss_rel_diff=1e-3)]).splitlines()
  assert len(rows) == 3
  assert '| 100.0 | 62.0 | 0.62x | 8 / 4 |' in rows[2]
  rec = dict(variant='unrolled', L=8, K=2, M=4, bytes_between_cells=8,
             matmul_ms=10.0, cast_ms=0.0, op_ms=40.0, ops_run=1000,
             onednn=False, step_ms=50.0)
  rows = transformer_report.MarkdownDtypes([
      dict(rec, dtype='float32'),
      dict(rec, dtype='bfloat16', step_ms=40.0, bytes_between_cells=4,
           cast_ms=3.0, op_ms=30.0, ops_run=1200)]).splitlines()
  assert rows[2] == ('| 8, 2, 4 | unrolled | 50.0 | 40.0 | 0.80x | 8 / 4 | '
                     '10.0 / 10.0 | 3.0 | 40.0 / 30.0 | 25% | 1000 / 1200 | '
                     'off |')
  # A CPU without bfloat16 units says so beside oneDNN's state.
  rows = transformer_report.MarkdownDtypes([
      dict(rec, dtype='float32', cpu_bf16_units=False),
      dict(rec, dtype='bfloat16', cpu_bf16_units=False)]).splitlines()
  assert rows[2].endswith('| off, CPU without bf16 units |'), rows[2]
  rows = pipeline_report.MarkdownDtypes([
      dict(common, dtype='float32', step_ms=100.0, bytes_between_cells=8),
      dict(common, dtype='bfloat16', step_ms=62.0, bytes_between_cells=4,
           cpu_bf16_units=False)]).splitlines()
  assert rows[2].endswith('| on, CPU without bf16 units |'), rows[2]

