"""Data-parallel replicas: every gradient_sync equals one large batch."""

import collections

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import optimizer
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext import session_config
from lingvo_ext.distributed import sync
from params import image
from params import lm
from tests.support import gpipe_testlib as lib

STRATEGIES = sync.STRATEGIES
B = 4  # Examples per replica.


def _TaskParams(model, batch, k=1, m=1, **kwargs):
  if model == 'lm':
    e = lm.TransformerLmTiny()
  else:
    e = image.ConvClassifierTiny()
  p = e.Task()
  p.input = e.Train()
  p.input.batch_size = batch
  if model == 'lm':
    p.input.seq_len = 16
  p.num_partitions = k
  p.num_micro_batches = m
  p.train.optimizer = optimizer.SGD.Params()
  p.train.learning_rate = 0.5
  p.train.clip_gradient_norm_to_value = 0.0
  p.Set(**kwargs)
  return p


def _Cluster(replicas, k):
  c = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=replicas * k, split_size=k)
  # The ps devices are the worker's CPUs, as in the trainer's local runs.
  c.params.ps.cpus_per_replica = replicas * k
  return c


def _Run(model, replicas, batch, steps=3, k=1, m=1, adam=False, save=None,
         restore=None, **kwargs):
  """Trains `steps` steps; returns losses, weights, copies and graph.

  Starts from the same random weights for every layout, or from checkpoint
  `restore`; saves to `save` (a path prefix) after training if given.
  """
  p = _TaskParams(model, batch, k, m, **kwargs)
  if adam:
    p.train.optimizer = optimizer.Adam.Params()
    p.train.learning_rate = 0.01
  graph = tf.Graph()
  with graph.as_default(), _Cluster(replicas, k):
    task, loss, init = lib.BuildTrainTask(p)
    config = session_config.WithoutIdlePasses(tf.config_pb2.ConfigProto(
        device_count={'CPU': replicas * k}, inter_op_parallelism_threads=4))
    saver = tf.train.Saver()
    with tf.Session(graph=graph, config=config) as sess:
      sess.run(init)
      if restore:
        saver.restore(sess, restore)
      else:
        # The same start for every layout.
        lib.LoadSeededWeights(sess, task.vars.Flatten())
      losses = [sess.run([loss, task.train_op])[0] for _ in range(steps)]
      if save:
        saver.save(sess, save)
      # One run each: a run per variable costs an executor per variable.
      weights = sess.run({v.op.name: v for v in task.vars.Flatten()})
      copies = {}
      task_sync = task.gradient_sync
      if task_sync is not None:
        copies = sess.run({(r, task.vars.GetItem(path).op.name): var
                           for (r, path), var in
                           task_sync.MirrorVariables().items()})
  return collections.namedtuple('Run', 'losses weights copies task graph')(
      losses, weights, copies, task, graph)


_CACHE = {}


def _Cached(*args, **kwargs):
  key = (args, tuple(sorted(kwargs.items())))
  if key not in _CACHE:
    _CACHE[key] = _Run(*args, **kwargs)
  return _CACHE[key]


def _AssertSameTraining(got, want):
  np.testing.assert_allclose(got.losses[0], want.losses[0], rtol=0, atol=1e-5)
  assert sorted(got.weights) == sorted(want.weights)
  for name, w in want.weights.items():
    np.testing.assert_allclose(got.weights[name], w, rtol=0, atol=1e-5,
                               err_msg=name)


@pytest.mark.e2e
@pytest.mark.parametrize('strategy', STRATEGIES)
def testLmTwoReplicasEqualOneReplicaOfTwiceTheBatch(strategy):
  want = _Cached('lm', 1, 2 * B)
  got = _Cached('lm', 2, B, gradient_sync=strategy)
  _AssertSameTraining(got, want)
  assert got.losses[-1] < got.losses[0]


@pytest.mark.e2e
@pytest.mark.parametrize('strategy', STRATEGIES)
def testPipelinedTwoReplicasEqualOneReplicaOfTwiceTheBatch(strategy):
  # Image classifier in K=2 cells over 2 micro-batches, 2 replicas on 4 CPUs.
  want = _Cached('image', 1, 2 * B, k=2, m=2)
  got = _Cached('image', 2, B, k=2, m=2, gradient_sync=strategy)
  _AssertSameTraining(got, want)


@pytest.mark.e2e
@pytest.mark.parametrize('strategy', STRATEGIES)
def testAccumulateTwoStepsEqualsOneReplicaOfFourTimesTheBatch(strategy):
  want = _Cached('lm', 1, 4 * B, steps=1)
  got = _Cached('lm', 2, B, steps=2, gradient_sync=strategy, accumulate_steps=2)
  # Step 1 only accumulated: its loss is that of the first half of the batch.
  assert sorted(got.weights) == sorted(want.weights)
  for name, w in want.weights.items():
    np.testing.assert_allclose(got.weights[name], w, rtol=0, atol=1e-5,
                               err_msg=name)


@pytest.mark.e2e
def testParameterServerWithOneReplicaEqualsShared():
  want = _Run('image', 1, 2 * B)
  got = _Run('image', 1, 2 * B, gradient_sync='parameter_server',
             accumulate_steps=1)
  _AssertSameTraining(got, want)
  assert len(got.task.gradient_sync.accumulators) == len(got.weights)


@pytest.mark.e2e
def testAllReduceCopiesStayBitIdentical():
  got = _Cached('lm', 2, B, gradient_sync='all_reduce')
  assert len(got.copies) == len(got.weights)
  for (r, name), copy in got.copies.items():
    assert r == 1
    np.testing.assert_array_equal(copy, got.weights[name], err_msg=name)
  acc = _Cached('lm', 2, B, steps=2, gradient_sync='all_reduce',
                accumulate_steps=2)
  for (_, name), copy in acc.copies.items():
    np.testing.assert_array_equal(copy, acc.weights[name], err_msg=name)


def _OpTypes(graph):
  return collections.Counter(op.type for op in graph.get_operations())


@pytest.mark.e2e
def testAllReduceGraphUsesCollectivesAndKeepsGradientsSparse():
  got = _Cached('lm', 2, B, gradient_sync='all_reduce')
  types = _OpTypes(got.graph)
  num_vars = len(got.weights)
  # Every dense variable, on both replicas; the embedding is gathered.
  assert types['CollectiveReduceV2'] == 2 * (num_vars - 1)
  assert types['CollectiveGatherV2'] == 2 * 2  # Values and indices.
  # IndexedSlices become dense through an UnsortedSegmentSum into the
  # vocabulary's rows; there is none (the learner's sum of repeated rows, for
  # the gradient norm, has as many rows as there are distinct ids).
  vocab = got.task.params.vocab_size
  assert not [op.name for op in got.graph.get_operations()
              if op.type == 'UnsortedSegmentSum' and (
                  'sum_duplicate_rows' not in op.name or
                  op.outputs[0].shape[0] == vocab)]
  gathers = [op for op in got.graph.get_operations()
             if op.type == 'CollectiveGatherV2']
  for op in gathers:  # A replica's token rows, not the vocabulary's.
    assert op.inputs[0].shape[0] == B * 16 != vocab
  assert {op.device for op in gathers} == {
      '/job:localhost/replica:0/task:0/device:CPU:0',
      '/job:localhost/replica:0/task:0/device:CPU:1'
  }
  stats = got.task.gradient_sync.stats
  assert stats.sparse_all_gather_bytes < stats.sparse_densified_bytes


@pytest.mark.e2e
def testAllReduceGroupsArePipelineStages():
  got = _Cached('image', 2, B, k=2, m=2, gradient_sync='all_reduce')
  devices = collections.defaultdict(set)
  for op in got.graph.get_operations():
    if op.type == 'CollectiveReduceV2':
      devices[op.inputs[2].op.get_attr('value').int_val[0]].add(
          op.device[-1])
  # Stage 0 on CPUs 0 and 2, stage 1 on CPUs 1 and 3.
  assert sorted(map(sorted, devices.values())) == [['0', '2'], ['1', '3']]


@pytest.mark.e2e
def testParameterServerAccumulatorsAreOnTheVariablesPsDevices():
  got = _Cached('lm', 2, B, gradient_sync='parameter_server')
  task_sync = got.task.gradient_sync
  ps_devices = {f'/job:localhost/replica:0/task:0/device:CPU:{i}'
                for i in range(2)}
  assert len(task_sync.accumulators) == len(got.weights)
  kinds = collections.Counter()
  for var, acc in task_sync.accumulators:
    assert acc.accumulator_ref.device == var.device
    assert var.device in ps_devices
    kinds[type(acc).__name__] += 1
  assert kinds == {'ConditionalAccumulator': len(got.weights) - 1,
                   'SparseConditionalAccumulator': 1}
  # Placed by size over both ps devices.
  assert {var.device for var, _ in task_sync.accumulators} == ps_devices
  types = _OpTypes(got.graph)
  assert types['CollectiveReduceV2'] == types['CollectiveGatherV2'] == 0


@pytest.mark.e2e
def testHybridGathersNothingAndReducesDense():
  got = _Cached('lm', 2, B, gradient_sync='hybrid')
  plans = got.task.gradient_sync.Plans()
  sparse = [path for path, plan in plans.items() if plan == 'ps']
  assert sparse == ['pipeline.d0.emb.emb']  # Leaves keep their names.
  types = _OpTypes(got.graph)
  assert types['CollectiveGatherV2'] == 0
  assert types['CollectiveReduceV2'] == 2 * (len(plans) - 1)
  assert types['SparseAccumulatorApplyGradient'] == 2


def _Build(replicas, k=1, **kwargs):
  p = _TaskParams('lm', B, k=k, **kwargs)
  with tf.Graph().as_default(), _Cluster(replicas, k):
    py_utils.GetOrCreateGlobalStepVar()
    return p.Instantiate()


@pytest.mark.parametrize('strategy', STRATEGIES)
def testGradientSyncMakesTheClassOfItsStrategy(strategy):
  got = sync.GradientSync('t', strategy, 2, accumulate_steps=3)
  assert isinstance(got, sync.GradientSync)
  assert type(got).STRATEGY == strategy
  assert got.num_replicas == 2


def testGradientSyncNamesTheStrategiesForAnUnknownOne():
  with pytest.raises(ValueError, match='gradient_sync=.allreduce. is not a '
                     'strategy; .* one of .*all_reduce'):
    sync.GradientSync('t', 'allreduce', 2)


def testBadDataParallelParamsAreClearErrors():
  with pytest.raises(ValueError, match='gradient_sync=.allreduce.*one of'):
    _Build(2, gradient_sync='allreduce')
  with pytest.raises(ValueError,
                     match=r'at least 2 .*--num_cpu_devices=2 '
                     r'--worker_split_size=1'):
    _Build(1, gradient_sync='all_reduce')
  with pytest.raises(ValueError, match=r'global batch 8 .*not divisible by '
                     r'replicas x micro-batches = 2 x 3; set '
                     r'task.input.batch_size'):
    _Build(2, m=3, gradient_sync='all_reduce')
  with pytest.raises(ValueError, match='accumulate_steps=0 must be'):
    _Build(2, accumulate_steps=0)
  with pytest.raises(ValueError, match='gradient_compression'):
    _Build(2, gradient_compression='int8')


@pytest.mark.e2e
def testFp16CompressionIsCloseAndHalvesTheBytes():
  full = _Cached('lm', 2, B, gradient_sync='all_reduce')
  half = _Cached('lm', 2, B, gradient_sync='all_reduce',
                 gradient_compression='fp16')
  assert (half.task.gradient_sync.stats.dense_all_reduce_bytes * 2 ==
          full.task.gradient_sync.stats.dense_all_reduce_bytes)
  for name, w in full.weights.items():
    np.testing.assert_allclose(half.weights[name], w, rtol=0, atol=1e-3)


@pytest.mark.e2e
def testAllReduceCheckpointHasOneCopyAndRestoresIntoSharedAndBack(tmp_path):
  # Adam, so the optimizer state moves between strategies too.
  kw = dict(k=2, m=2, adam=True)
  ar_ckpt, shared_ckpt = str(tmp_path / 'ar'), str(tmp_path / 'shared')
  ar = _Run('image', 2, B, steps=2, save=ar_ckpt, gradient_sync='all_reduce',
            **kw)
  names = [n for n, _ in tf.train.list_variables(ar_ckpt)]
  assert not [n for n in names if 'replica' in n]
  assert set(ar.weights) <= set(names)
  # all_reduce -> shared: the same weights, and the same next step as
  # all_reduce's own.
  shared = _Run('image', 2, B, steps=1, restore=ar_ckpt, save=shared_ckpt,
                **kw)
  ar_next = _Run('image', 2, B, steps=1, restore=ar_ckpt,
                 gradient_sync='all_reduce', **kw)
  _AssertSameTraining(ar_next, shared)
  # shared -> all_reduce: every replica starts from the restored copy.
  back = _Run('image', 2, B, steps=2, restore=shared_ckpt,
              gradient_sync='all_reduce', **kw)
  shared_next = _Run('image', 2, B, steps=2, restore=shared_ckpt, **kw)
  _AssertSameTraining(back, shared_next)
  for (_, name), copy in back.copies.items():
    np.testing.assert_array_equal(copy, back.weights[name], err_msg=name)


@pytest.mark.e2e
def testHybridWithAdamKeepsCopiesBitIdentical():
  # Replica 1's optimizer has slots for the replicated variables only; they
  # are taken from replica 0's at the first update.
  got = _Run('lm', 2, B, steps=3, adam=True, gradient_sync='hybrid')
  assert len(got.copies) == len(got.weights) - 1  # All but the embedding.
  for (_, name), copy in got.copies.items():
    np.testing.assert_array_equal(copy, got.weights[name], err_msg=name)
