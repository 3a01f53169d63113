"""NmtInput with Lingvo's mixed bucket batch limits pipelines
(tasks/bucketed_input.py): each bucket's batch padded to the static batch
by rows no metric counts, on the GPipe NMT experiment (mt_testlib)."""

from lingvo_ext import entry_point

# isort: split
import lingvo.compat as tf
import numpy as np
import pytest

from lingvo_ext.tasks import bucketed_input
from lingvo_ext.tasks import experiment_params
from tests.support import mt_testlib

mt = pytest.fixture(scope='module', name='mt')(mt_testlib.Fixture)
_SEEDED = 'input.file_random_seed:301'


def _Batches(cfg, count):
  with tf.Graph().as_default():
    batch = cfg.input.Instantiate().GetPreprocessedInputBatch()
    with tf.Session() as sess:
      return [sess.run(batch) for _ in range(count)]


def testMixedLimitsGiveStaticBatchesPaddedByUncountedRows(mt):
  del mt
  cfg = experiment_params.GetParams(mt_testlib.BUCKETS_MODEL, 'Train',
                                    _SEEDED)
  assert bucketed_input.NeedsPadding(cfg.input)
  static = max(mt_testlib.TRAIN_LIMITS)
  with tf.Graph().as_default():
    batch = cfg.input.Instantiate().GetPreprocessedInputBatch()
    assert batch.src.ids.shape.as_list() == [static, None]
    assert batch.tgt.weights.shape.as_list() == [static, None]
  sizes = set()
  for b in _Batches(cfg, 12):
    real = np.sum(1 - b.src.paddings, 1) > 0
    n = int(real.sum())
    assert real[:n].all() and not real[n:].any()  # Real rows first.
    sizes.add(n)
    bound = mt_testlib.TRAIN_BOUNDS[mt_testlib.TRAIN_LIMITS.index(n)]
    assert b.src.ids.shape[1] <= bound
    assert (b.tgt.paddings[n:] == 1).all() and (b.tgt.weights[n:] == 0).all()
    assert (b.src.ids[n:] == 0).all() and (b.tgt.labels[n:] == 0).all()
  assert sizes == set(mt_testlib.TRAIN_LIMITS), sizes  # Every bucket.
  # The static experiment needs none.
  static_cfg = experiment_params.GetParams(mt_testlib.MODEL, 'Train')
  assert not bucketed_input.NeedsPadding(static_cfg.input)
  assert static_cfg.task.cls.__name__ == 'GPipeTransformerModel'
  assert not issubclass(static_cfg.input.cls, bucketed_input._PadsToFixedShape)  # pylint: disable=protected-access


def _EvalMetrics(cfg, batches, devices, overrides_task=None):
  """The task's eval metrics on each batch (fed as is), on `devices`."""
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from tests.support import gpipe_testlib  # pylint: disable=g-import-not-at-top
  assert entry_point.ParseFlags() is None
  g = tf.Graph()
  with g.as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='evaler', cpus=devices, split_size=devices,
      do_eval=True):
    py_utils.GetOrCreateGlobalStepVar()
    task_p = cfg.task.Copy()
    if overrides_task:
      overrides_task(task_p)
    task_p.input = cfg.input
    task = task_p.Instantiate()
    rows = batches[0].src.ids.shape[0] if devices > 1 else None
    feeds = py_utils.NestedMap(
        src=py_utils.NestedMap(
            ids=tf.placeholder(tf.int32, [rows, None]),
            paddings=tf.placeholder(tf.float32, [rows, None])),
        tgt=py_utils.NestedMap(
            ids=tf.placeholder(tf.int32, [rows, None]),
            labels=tf.placeholder(tf.int32, [rows, None]),
            weights=tf.placeholder(tf.float32, [rows, None]),
            paddings=tf.placeholder(tf.float32, [rows, None])))
    metrics, _ = task.FPropTower(task.theta, feeds.Transform(tf.identity))
    variables = task.vars.Flatten()
    init = tf.global_variables_initializer()
  results = []
  with gpipe_testlib.Session(g, devices) as sess:
    sess.run(init)
    gpipe_testlib.LoadSeededWeights(sess, variables)
    for b in batches:
      values = sess.run({k: v[0] for k, v in metrics.items()}, dict(
          zip(feeds.Flatten(), [np.asarray(x) for x in b.Flatten()])))
      results.append({k: float(v) for k, v in values.items()})
  return results


def testPaddedBucketsEvaluateAsTheirRealRowsInSequence(mt):
  del mt
  cfg = experiment_params.GetParams(mt_testlib.BUCKETS_MODEL, 'Train',
                                    _SEEDED)
  padded = [b.Filter(lambda _: True) for b in _Batches(cfg, 6)]
  for b in padded:
    del b['bucket_keys']
  real = []
  for b in padded:
    n = int((np.sum(1 - b.src.paddings, 1) > 0).sum())
    real.append(b.Transform(lambda x, n=n: x[:n]))
  pipelined = _EvalMetrics(cfg, padded, devices=2)
  sequential = _EvalMetrics(cfg, real, devices=1)
  for pipe, seq, b in zip(pipelined, sequential, real):
    assert pipe['num_samples_in_batch'] == len(b.src.ids)  # Real rows only.
    for k in ('loss', 'log_pplx'):
      assert pipe[k] == pytest.approx(seq[k], rel=1e-5, abs=1e-6), k


def testPaddedRowsAreNotDecoded(mt):
  del mt
  cfg = experiment_params.GetParams(mt_testlib.BUCKETS_MODEL, 'Dev')
  assert cfg.task.cls.__name__ == 'GPipeTransformerModel'
  assert issubclass(cfg.task.cls, bucketed_input._CountsRealMtRows)  # pylint: disable=protected-access
  assert entry_point.ParseFlags() is None
  with tf.Graph().as_default():
    task_p = cfg.task.Copy()
    task_p.input = cfg.input
    task = task_p.Instantiate()
    dec_metrics = task.CreateDecoderMetrics()
  word = mt_testlib.WPM_SPACE + 'the'
  out = {
      'sources': np.array([word, word, b''], object),
      'targets': np.array([word, word, b''], object),
      'topk_decoded': np.array([[word] * 2, [word, ''], ['', '']], object),
      'topk_scores': np.zeros([3, 2]),
      'target_paddings': np.array([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]]),
  }
  pairs = task.PostProcessDecodeOut(out, dec_metrics)
  assert len(pairs) == 2
  assert dec_metrics['num_samples_in_batch'].total_value == 2
