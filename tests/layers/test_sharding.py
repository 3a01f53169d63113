"""Partitioned embedding and softmax variables (lingvo_ext.layers.sharding).

Partitioned layers must equal unpartitioned ones given the same table:
outputs and gradients to 1e-6 for every TF partitioner and both strategies;
shards sit on the documented devices; shard gradients of the lookup are
IndexedSlices; checkpoints re-partition (3 -> 2, 3 -> 1, 1 -> 4) with the
optimizer's slots; bad params raise a ValueError naming the param. The
registered lm.WordLmShardedTiny trains like lm.WordLmTiny through the trainer,
and each resumes the other's checkpoints.
"""

import os
import re
import subprocess
import sys
import tempfile

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np
import pytest

from lingvo_ext import layers
from lingvo_ext.layers import sharding
from tests.support import ROOT as _ROOT
from tests.support import gpipe_testlib
from tests.support import zygote

VOCAB = 50
DIM = 4
NUM_DEVICES = 4

PARTITIONERS = {
    'fixed_size': ('fixed_size', dict(num_shards=3)),
    # [50, 4] float32 is 800 bytes: 64-byte slices allow 12, capped at 4.
    'min_max': ('min_max', dict(max_partitions=4, min_slice_size=64)),
    # 800 bytes in shards of at most 300: 3 shards.
    'variable_axis_size': ('variable_axis_size', dict(max_shard_bytes=300)),
}


def _Cluster(num_devices=NUM_DEVICES):
  return cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=num_devices,
      split_size=num_devices)


def _Session(graph, num_devices=NUM_DEVICES):
  return gpipe_testlib.Session(graph, num_devices)


def _Emb(**kw):
  return layers.EmbeddingLayer.Params().Set(
      name='emb', vocab_size=VOCAB, embedding_dim=DIM, max_seq_len=8,
      position_embedding='NONE', **kw)


def _Softmax(**kw):
  return layers.SoftmaxLayer.Params().Set(
      name='sm', input_dim=DIM, num_classes=VOCAB, **kw)


def _ToShards(full, sizes, strategy, axis):
  """Cuts a full table into shards as `strategy` lays ids out."""
  full = np.moveaxis(full, axis, 0)
  n = len(sizes)
  if strategy == 'mod':
    parts = [full[i::n] for i in range(n)]
  else:
    offsets = np.cumsum([0] + sizes)
    parts = [full[offsets[i]:offsets[i + 1]] for i in range(n)]
  assert [len(x) for x in parts] == sizes
  return [np.moveaxis(x, 0, axis) for x in parts]


def _FromShards(parts, strategy, axis):
  parts = [np.moveaxis(x, axis, 0) for x in parts]
  n = len(parts)
  if strategy == 'mod':
    full = np.zeros((sum(len(x) for x in parts),) + parts[0].shape[1:],
                    parts[0].dtype)
    for i, x in enumerate(parts):
      full[i::n] = x
  else:
    full = np.concatenate(parts, axis=0)
  return np.moveaxis(full, 0, axis)


def _Dense(g):
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _RunLayer(p, inputs, values):
  """Outputs, gradients (as numpy) and gradient types of layer p.

  Args:
    p: Layer params.
    inputs: numpy inputs.
    values: {var path: full numpy value}; shards get their slices.

  Returns:
    (output, {var path: full gradient}, {var path: [gradient type names]})
  """
  strategy = p.partition_strategy
  g = tf.Graph()
  with g.as_default(), _Cluster():
    layer = p.Instantiate()
    x = tf.constant(inputs)
    y = layer.FProp(layer.theta, x)
    w = tf.constant(np.random.RandomState(7).uniform(
        -1, 1, y.shape.as_list()).astype(np.float32))
    loss = tf.reduce_sum(y * w)
    flat = layer.vars.FlattenItems()
    grads = tf.gradients(loss, [v for _, v in flat])
    kinds = {}
    for (path, _), gr in zip(flat, grads):
      key = path.rsplit('[', 1)[0] if path.endswith(']') else path
      kinds.setdefault(key, []).append(type(gr).__name__)
    dense = [_Dense(gr) for gr in grads]
    with _Session(g) as sess:
      sess.run(tf.global_variables_initializer())
      by_key = {}
      for (path, v) in flat:
        key = path.rsplit('[', 1)[0] if path.endswith(']') else path
        by_key.setdefault(key, []).append(v)
      for key, full in values.items():
        vs = by_key[key]
        axis = 1 if key == 'logits.w' else 0
        if len(vs) == 1 and not sharding.IsShard(vs[0]):
          vs[0].load(full, sess)
          continue
        sizes = [int(v.shape[axis]) for v in vs]
        for v, part in zip(vs, _ToShards(full, sizes, strategy, axis)):
          v.load(part, sess)
      out, grad_values = sess.run([y, dense])
  by_key_grads = {}
  for (path, v), gv in zip(flat, grad_values):
    key = path.rsplit('[', 1)[0] if path.endswith(']') else path
    by_key_grads.setdefault(key, []).append(gv)
  full_grads = {}
  for key, parts in by_key_grads.items():
    axis = 1 if key == 'logits.w' else 0
    full_grads[key] = (parts[0] if len(parts) == 1 else
                       _FromShards(parts, strategy, axis))
  return out, full_grads, kinds


@pytest.mark.parametrize('strategy', ['div', 'mod'])
@pytest.mark.parametrize('partitioner', sorted(PARTITIONERS))
def test_embedding_equals_unpartitioned(partitioner, strategy):
  rng = np.random.RandomState(0)
  table = rng.uniform(-1, 1, [VOCAB, DIM]).astype(np.float32)
  ids = rng.randint(0, VOCAB, [3, 8]).astype(np.int32)
  ids[0, :] = [0, 1, 2, 48, 49, 17, 17, 3]
  base, base_g, _ = _RunLayer(_Emb(), ids, {'emb': table})
  spec = PARTITIONERS[partitioner]
  p = _Emb(partitioner=spec, partition_strategy=strategy)
  assert sharding.NumShards(p, [VOCAB, DIM], tf.float32) > 1
  out, grads, kinds = _RunLayer(p, ids, {'emb': table})
  np.testing.assert_allclose(out, base, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(grads['emb'], base_g['emb'], rtol=1e-6, atol=1e-6)
  # Each shard's gradient is sparse, never densified.
  assert set(kinds['emb']) == {'IndexedSlices'}, kinds
  assert len(kinds['emb']) > 1


@pytest.mark.parametrize('strategy', ['div', 'mod'])
@pytest.mark.parametrize('partitioner', sorted(PARTITIONERS))
def test_softmax_equals_unpartitioned(partitioner, strategy):
  rng = np.random.RandomState(1)
  w = rng.uniform(-1, 1, [DIM, VOCAB]).astype(np.float32)
  b = rng.uniform(-1, 1, [VOCAB]).astype(np.float32)
  x = rng.uniform(-1, 1, [3, 5, DIM]).astype(np.float32)
  values = {'logits.w': w, 'logits.b': b}
  base, base_g, _ = _RunLayer(_Softmax(apply_layer_norm=True), x, values)
  spec = PARTITIONERS[partitioner]
  p = _Softmax(apply_layer_norm=True, partitioner=spec,
               partition_strategy=strategy)
  assert sharding.NumShards(p, [DIM, VOCAB], tf.float32, axis=1) > 1
  out, grads, _ = _RunLayer(p, x, values)
  np.testing.assert_allclose(out, base, rtol=1e-6, atol=1e-6)
  for key in ('logits.w', 'logits.b', 'ln.scale', 'ln.bias'):
    np.testing.assert_allclose(grads[key], base_g[key], rtol=1e-6, atol=1e-6,
                               err_msg=key)


def test_shard_devices_round_robin_over_model_split():
  p = _Emb(partitioner=('fixed_size', dict(num_shards=6)))
  sp = _Softmax(partitioner=('fixed_size', dict(num_shards=5)))
  g = tf.Graph()
  with g.as_default(), _Cluster() as cluster:
    emb = p.Instantiate()
    sm = sp.Instantiate()
    y = sm.FProp(sm.theta, emb.FProp(emb.theta, tf.zeros([2, 3], tf.int32)))
    del y
    split = [cluster.WorkerDeviceInModelSplit(i) for i in range(NUM_DEVICES)]
    meta_e = layers.EmbeddingLayer.FPropMeta(p, tshape.Shape([2, 3]))
    meta_s = layers.SoftmaxLayer.FPropMeta(sp, tshape.Shape([2, 3, DIM]))
  shards = list(emb.vars.emb)
  assert [v.device for v in shards] == [split[i % 4] for i in range(6)]
  assert [m.device for m in meta_e.param_shards] == [
      split[i % 4] for i in range(6)]
  assert [m.bytes for m in meta_e.param_shards] == [
      r * DIM * 4 for r in (9, 9, 8, 8, 8, 8)]
  ws = list(sm.vars.logits.w)
  assert [v.device for v in ws] == [split[i % 4] for i in range(5)]
  assert [v.shape.as_list() for v in ws] == [[DIM, 10]] * 5
  assert [v.device for v in sm.vars.logits.b] == [v.device for v in ws]
  w_meta = [m for m in meta_s.param_shards if m.var == 'logits.w']
  assert [m.device for m in w_meta] == [v.device for v in ws]
  # The lookups and the per-shard matmuls run where the shards live.
  gathers = [op for op in g.get_operations() if op.type == 'ResourceGather']
  assert sorted(op.device for op in gathers) == sorted(v.device
                                                       for v in shards)
  matmuls = [op for op in g.get_operations() if op.type == 'MatMul']
  assert sorted(op.device for op in matmuls) == sorted(v.device for v in ws)


def test_shard_devices_round_robin_over_ps_tasks():
  cp = cluster_factory.Cluster.Params()
  cp.mode = 'sync'
  cp.job = 'trainer_client'
  cp.worker.name = '/job:trainer'
  cp.worker.replicas = 1
  cp.ps.name = '/job:ps'
  cp.ps.replicas = 3
  p = _Emb(partitioner=('fixed_size', dict(num_shards=4)))
  with tf.Graph().as_default(), cp.Instantiate():
    emb = p.Instantiate()
    meta = layers.EmbeddingLayer.FPropMeta(p, tshape.Shape([2, 3]))
  want = ['/job:ps/replica:0/task:%d/device:CPU:0' % (i % 3) for i in range(4)]
  assert [v.device for v in emb.vars.emb] == want
  assert [m.device for m in meta.param_shards] == want


def test_one_device_leaves_placement_alone():
  p = _Emb(partitioner=('fixed_size', dict(num_shards=2)))
  with tf.Graph().as_default(), _Cluster(1):
    emb = p.Instantiate()
  assert [v.device for v in emb.vars.emb] == ['', '']


@pytest.mark.parametrize('make,match', [
    (lambda: _Emb(partitioner=('fixed', dict(num_shards=2))),
     r'EmbeddingLayer\.partitioner.*unknown partitioner \'fixed\''),
    (lambda: _Emb(partitioner=('fixed_size', dict(shards=2))),
     r'EmbeddingLayer\.partitioner.*unknown argument\(s\) shards'),
    (lambda: _Emb(partitioner=('fixed_size', dict(num_shards=2, axis=1))),
     r'EmbeddingLayer\.partitioner.*unknown argument\(s\) axis'),
    (lambda: _Emb(partitioner=('min_max', dict(max_partitions=0))),
     r'EmbeddingLayer\.partitioner.*max_partitions=0 must be a positive'),
    (lambda: _Emb(partitioner='fixed_size'),
     r'EmbeddingLayer\.partitioner.*\(name, dict of arguments\)'),
    (lambda: _Emb(partitioner=('fixed_size', dict(num_shards=VOCAB + 1))),
     r'EmbeddingLayer\.partitioner.*51 shards of a variable with only 50'),
    (lambda: _Softmax(partitioner=('fixed_size', dict(num_shards=VOCAB + 1))),
     r'SoftmaxLayer\.partitioner.*51 shards of a variable with only 50'),
    (lambda: _Emb(partitioner=('fixed_size', dict(num_shards=2)),
                  partition_strategy='modulo'),
     r'EmbeddingLayer\.partition_strategy=\'modulo\''),
    (lambda: _Softmax(partition_strategy='MOD'),
     r'SoftmaxLayer\.partition_strategy=\'MOD\''),
])
def test_bad_params(make, match):
  p = make()
  with tf.Graph().as_default(), _Cluster(1):
    with pytest.raises(ValueError, match=match):
      p.Instantiate()
  shape = [2, 3] if p.cls is layers.EmbeddingLayer else [2, DIM]
  with pytest.raises(ValueError, match=match):
    p.cls.FPropMeta(p, tshape.Shape(shape))


def test_cost_report_lists_shards_and_devices():
  from lingvo_ext.tools import cost_report  # pylint: disable=g-import-not-at-top
  stack = [
      _Emb(partitioner=('fixed_size', dict(num_shards=4))),
      _Softmax(partitioner=('min_max', dict(max_partitions=2,
                                            min_slice_size=64))),
  ]
  with _Cluster() as cluster:
    report = cost_report.BuildReport(stack, (tshape.Shape([2, 3]),), 1)
    split = [cluster.WorkerDeviceInModelSplit(i) for i in range(NUM_DEVICES)]
  emb, sm = report['layers']
  assert [(s['var'], s['shape'], s['bytes'], s['device'])
          for s in emb['param_shards']] == [
              ('emb', [r, DIM], r * DIM * 4, split[i])
              for i, r in enumerate([13, 13, 12, 12])]
  assert [(s['var'], s['shape'], s['device']) for s in sm['param_shards']] == [
      ('logits.w', [DIM, 25], split[0]), ('logits.w', [DIM, 25], split[1]),
      ('logits.b', [25], split[0]), ('logits.b', [25], split[1])]
  by_device = report['shard_bytes_by_device']
  assert by_device[split[0]] == 13 * DIM * 4 + 25 * DIM * 4 + 25 * 4
  assert by_device[split[3]] == 12 * DIM * 4
  assert sum(by_device.values()) == emb['param_bytes'] + sm['param_bytes']
  text = cost_report.FormatReport(report)
  assert 'parameter shards:' in text and split[3] in text


def test_pipeline_reads_shards_in_place():
  """In a GPipe pipeline the shards are looked up where they live."""
  from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
  spec = ('fixed_size', dict(num_shards=4))
  stack = [_Emb(partitioner=spec), _Softmax(partitioner=spec)]
  g = tf.Graph()
  with g.as_default(), _Cluster():
    py_utils.GetOrCreateGlobalStepVar()  # Seeds the micro-batches.
    cells = gpipe.PartitionSequentialLayers(stack, 2, tshape.Shape([4, 6]))
    pipe = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=2,
        state_dtype=tf.float32).Instantiate()
    ids = tf.constant(np.random.RandomState(5).randint(0, VOCAB, [4, 6]),
                      tf.float32)
    y = pipe.FProp(pipe.theta, ids)
    shards = [v for v in pipe.vars.Flatten() if sharding.IsShard(v)]
    emb = [v for v in shards if '/emb/' in v.name]
    grads = tf.gradients(tf.reduce_sum(y * y), emb)
    y_seq = pipe.FPropSequential(pipe.theta, ids)
    grads_seq = tf.gradients(tf.reduce_sum(y_seq * y_seq), emb)
    dense = [tf.convert_to_tensor(gr) for gr in grads + grads_seq]
    with _Session(g) as sess:
      sess.run(tf.global_variables_initializer())
      values = sess.run([y, y_seq] + dense)
  np.testing.assert_allclose(values[0], values[1], rtol=1e-6, atol=1e-6)
  for a, b in zip(values[2:6], values[6:]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert len(emb) == 4 and len(shards) == 12
  # Summed over micro-batches, the shards' gradients stay sparse.
  assert {type(gr).__name__ for gr in grads} == {'IndexedSlices'}
  # Two micro-batches and the sequential run: three gathers from each
  # embedding shard, on its device.
  gathers = [op for op in g.get_operations() if op.type == 'ResourceGather']
  assert sorted(op.device for op in gathers) == sorted(
      [v.device for v in emb] * 3)
  # No shard is copied whole onto a cell's device.
  handles = {v.handle.op.name for v in shards}
  for op in g.get_operations():
    if op.type == 'Identity' and op.inputs:
      src = op.inputs[0].op
      assert not (src.type == 'ReadVariableOp' and
                  src.inputs[0].op.name in handles), op.name


# Checkpoints: N shards -> M shards, with the optimizer's slots.


def _Model(num_shards, opt_name):
  """An embedding and softmax LM step; num_shards=1 is unpartitioned.

  Returns (logits, loss, train op, variables, {(full name, slot or 'var'):
  list of shard variables}).
  """
  spec = None if num_shards == 1 else ('fixed_size',
                                       dict(num_shards=num_shards))
  emb = _Emb(partitioner=spec).Instantiate()
  sm = _Softmax(partitioner=spec).Instantiate()
  rng = np.random.RandomState(3)
  ids = tf.constant(rng.randint(0, VOCAB, [4, 6]).astype(np.int32))
  labels = tf.constant(rng.randint(0, VOCAB, [4, 6]).astype(np.int32))
  logits = sm.FProp(sm.theta, emb.FProp(emb.theta, ids))
  loss = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits))
  variables = emb.vars.Flatten() + sm.vars.Flatten()
  if opt_name == 'adam':
    opt = tf.train.AdamOptimizer(0.05)
    slot_names = ('m', 'v')
  else:
    opt = tf.train.AdagradOptimizer(0.5)
    slot_names = ('accumulator',)
  train = opt.minimize(loss, var_list=variables)
  slots = {}
  for v in variables:
    key = v._save_slice_info.full_name if sharding.IsShard(v) else v.op.name
    slots.setdefault((key, 'var'), []).append(v)
    for s in slot_names:
      slots.setdefault((key, s), []).append(opt.get_slot(v, s))
  return logits, loss, train, variables, slots


def _Full(values):
  """Concatenates shard values (div) along their partitioned axis."""
  if len(values) == 1:
    return values[0]
  axis = 1 if values[0].ndim == 2 and values[0].shape[0] == DIM else 0
  return np.concatenate(values, axis=axis)


@pytest.mark.parametrize('opt_name', ['adam', 'adagrad'])
@pytest.mark.parametrize('saved,restored', [(3, 2), (3, 1), (1, 4)])
def test_checkpoint_repartitions(saved, restored, opt_name):
  ckpt = os.path.join(tempfile.mkdtemp(), 'model')
  results = []
  for n, save in ((saved, True), (restored, False)):
    g = tf.Graph()
    with g.as_default(), _Cluster():
      tf.compat.v1.set_random_seed(1 + n)  # Different init: restore must win.
      logits, loss, train, variables, slots = _Model(n, opt_name)
      saver = tf.train.Saver()
      with _Session(g) as sess:
        if save:
          sess.run(tf.global_variables_initializer())
          for _ in range(2):
            sess.run(train)
          saver.save(sess, ckpt)
        else:
          saver.restore(sess, ckpt)
        # Shards per variable as TF cut them.
        assert max(len(v) for v in slots.values()) == n
        out = sess.run(logits)
        slot_values = {k: _Full(sess.run(v)) for k, v in slots.items()}
        sess.run(train)  # One more step from the restored slots.
        after = sess.run(loss)
    results.append((out, slot_values, after))
  (out0, slots0, after0), (out1, slots1, after1) = results
  # Variables and slots come back bit for bit.
  assert sorted(slots0) == sorted(slots1)
  for k in slots0:
    np.testing.assert_array_equal(slots1[k], slots0[k], err_msg=str(k))
  # Outputs agree to float rounding: a matmul over differently sized shards
  # may sum in another order.
  np.testing.assert_allclose(out1, out0, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(after1, after0, rtol=1e-6)


# The registered word LMs through lingvo_ext.trainer.


def _Trainer(model, logdir, *flags):
  """Runs the trainer (forked from the tests' pre-imported server where it
  can be, tests/support/zygote.py); its stdout and stderr."""
  proc = zygote.run(
      # --alsologtostderr: Lingvo's step lines (log_pplx) in the output.
      [sys.executable, '-m', 'lingvo_ext.trainer', '--alsologtostderr',
       f'--model={model}', f'--logdir={logdir}', *flags],
      cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=400)
  assert proc.returncode == 0, proc.stdout[-5000:]
  return proc.stdout


def _LogPplx(out):
  """{step: log_pplx} from the trainer's step lines."""
  return {
      int(m.group(1)): float(m.group(2)) for m in re.finditer(
          r'step:\s*(\d+),.*? log_pplx:([0-9.eE+-]+)', out)
  }


@pytest.mark.e2e
def test_word_lm_sharded_trains_like_unsharded_and_checkpoints_cross(
    tmp_path):
  flags = ('--num_cpu_devices=4', '--worker_split_size=4')
  sharded, plain = str(tmp_path / 'sharded'), str(tmp_path / 'plain')
  out_s = _Trainer('lm.WordLmShardedTiny', sharded, '--max_steps=2', *flags)
  out_p = _Trainer('lm.WordLmTiny', plain, '--max_steps=2', *flags)
  # Same names, same stateless initial values, same math.
  pplx_s, pplx_p = _LogPplx(out_s), _LogPplx(out_p)
  assert sorted(pplx_s) == [1, 2] and sorted(pplx_p) == [1, 2], (pplx_s,
                                                                 pplx_p)
  for step in (1, 2):
    assert pplx_s[step] == pytest.approx(pplx_p[step], rel=1e-5)
  # TF's saved slices: the unpartitioned model resumes the sharded one.
  ckpt = tf.train.list_variables(os.path.join(sharded, 'train'))
  assert not [n for n, _ in ckpt if '/part_' in n], ckpt
  out = _Trainer('lm.WordLmTiny', sharded, '--max_steps=3')
  assert sorted(_LogPplx(out)) == [3], out[-3000:]
