"""A GPipe Transformer NMT experiment on Lingvo (tests/support/mt_testlib.py).

In process: the copy keeps Lingvo's tables scaled down; NmtInput reads its
tfrecords (the reversed-word corpus) as Lingvo builds them; every schedule
trains as the sequential model does.
"""

from lingvo_ext import entry_point

# isort: split
import lingvo.compat as tf
import numpy as np
import pytest

from lingvo_ext.tasks import experiment_params
from tests.support import mt_testlib

mt = pytest.fixture(scope='module', name='mt')(mt_testlib.Fixture)


def testTheCopyKeepsLingvosTablesScaledDown(mt):
  del mt
  train = experiment_params.GetParams(mt_testlib.MODEL, 'Train')
  assert train.input.cls.__name__ == 'NmtInput'
  assert train.input.pad_to_max_seq_length
  assert train.input.bucket_upper_bound == list(mt_testlib.TRAIN_BOUNDS)
  assert train.input.bucket_batch_limit == [max(mt_testlib.TRAIN_LIMITS)] * 3
  assert train.input.source_max_length == mt_testlib.MAX_LENGTH
  buckets = experiment_params.GetParams(mt_testlib.BUCKETS_MODEL, 'Train')
  assert buckets.input.bucket_batch_limit == list(mt_testlib.TRAIN_LIMITS)
  assert not buckets.input.pad_to_max_seq_length
  dev = experiment_params.GetParams(mt_testlib.BUCKETS_MODEL, 'Dev')
  assert dev.input.bucket_upper_bound == list(mt_testlib.EVAL_BOUNDS)
  assert 'dev.tfrecords' in dev.input.file_pattern
  task = train.task
  assert task.cls.__name__ == 'GPipeTransformerModel'
  assert task.stack.batch_dim == 1  # Time-major, as Lingvo builds it.
  assert (task.stack.num_encoder_layers, task.stack.num_decoder_layers) == (
      2, 2)
  # The unscaled experiment keeps Lingvo's WMT'14 tables.
  import lingvo_mt_gpipe  # pylint: disable=g-import-not-at-top
  base = lingvo_mt_gpipe.WmtEnDeGPipeTransformer()
  assert base.Train().bucket_batch_limit == list(
      mt_testlib.LINGVO_TRAIN_LIMITS)
  assert base.Dev().bucket_batch_limit == list(mt_testlib.LINGVO_EVAL_LIMITS)
  assert base.Task().stack.label_smoothing.uncertainty == 0.1


def testNmtInputReadsTheReversedCorpus(mt):
  del mt
  cfg = experiment_params.GetParams(mt_testlib.MODEL, 'Train')
  with tf.Graph().as_default():
    gen = cfg.input.Instantiate()
    batch = gen.GetPreprocessedInputBatch()
    with tf.Session() as sess:
      b = sess.run(batch)
  rows, length = max(mt_testlib.TRAIN_LIMITS), mt_testlib.MAX_LENGTH
  assert b.src.ids.shape == (rows, length) == b.tgt.labels.shape
  eos = mt_testlib.SPECIALS.index('</s>')
  sos = mt_testlib.SPECIALS.index('<s>')
  for i in range(rows):
    n = int(np.sum(1 - b.src.paddings[i]))
    src = list(b.src.ids[i, :n])
    assert src[-1] == eos and n - 1 >= mt_testlib.MIN_WORDS
    words = src[:-1]
    assert list(b.tgt.labels[i, :n]) == words[::-1] + [eos]
    assert list(b.tgt.ids[i, :n]) == [sos] + words[::-1]
    assert (b.tgt.weights[i, :n] == 1).all() and (b.tgt.weights[i, n:] == 0
                                                  ).all()


STEPS = 5
# The same batches in the same order for every build.
_SEEDED = 'input.file_random_seed:301'


def _SeededWeights(sess, variables):
  """gpipe_testlib.LoadSeededWeights, seeded by each variable's name without
  its cell (cell_1/decoder_0/... and cell_0/decoder_0/... start alike)."""
  import re  # pylint: disable=g-import-not-at-top
  import zlib  # pylint: disable=g-import-not-at-top
  feeds, assigns = {}, []
  for v in variables:
    key = re.sub(r'cell_\d+/', '', v.op.name)
    rng = np.random.RandomState(zlib.crc32(key.encode()))
    ph = tf.placeholder(v.dtype.base_dtype, v.shape)
    feeds[ph] = (rng.randn(*v.shape.as_list()) * 0.1).astype(np.float32)
    assigns.append(tf.assign(v, ph))
  sess.run(assigns, feed_dict=feeds)


def _Train(overrides, devices, engine='lingvo_ext', steps=STEPS,
           model=mt_testlib.MODEL):
  """The training loss of each of `steps` steps of the MT task."""
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top

  from tests.support import gpipe_testlib as lib  # pylint: disable=g-import-not-at-top
  assert entry_point.ParseFlags() is None  # The decoder reads Lingvo's flags.
  cfg = experiment_params.GetParams(
      model, 'Train', ';'.join([_SEEDED] + overrides),
      gpipe_engine=engine)
  p = cfg.task.Copy()
  p.input = cfg.input
  graph = tf.Graph()
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=devices, split_size=devices)
  with graph.as_default(), cluster:
    tf.random.set_seed(1)
    task, loss, init = lib.BuildTrainTask(p)
    with lib.Session(graph, devices) as sess:
      sess.run(init)
      _SeededWeights(sess, task.vars.Flatten())
      return [float(sess.run([loss, task.train_op])[0]) for _ in range(steps)]


_SEQUENTIAL = ['task.stack.splits:1', 'task.stack.num_micro_batches:1']
# (name, overrides, devices, engine): 2 cells, 2 micro-batches on 2 devices;
# 'zbv' 4 cells (two on each device); Lingvo's own engine ('lingvo').
VARIANTS = [(s, [f'task.stack.schedule:"{s}"'], 2, 'lingvo_ext')
            for s in ('unrolled', 'recurrent', '1f1b', 'interleaved_1f1b',
                      'zero_bubble')] + [
                ('zbv', ['task.stack.schedule:"zbv"', 'task.stack.splits:4'],
                 2, 'lingvo_ext'),
                ('lingvo', [], 2, 'lingvo')]


@pytest.mark.e2e
@pytest.mark.parametrize('name,overrides,devices,engine', VARIANTS,
                         ids=[v[0] for v in VARIANTS])
def testEveryScheduleTrainsAsTheSequentialModel(mt, shared_once, name,
                                                 overrides, devices, engine):
  del mt
  reference = shared_once('mt_sequential_losses',
                          lambda unused_path: _Train(_SEQUENTIAL, 1))
  assert len(reference) == STEPS and np.all(np.isfinite(reference))
  assert reference[-1] < reference[0]  # It trains.
  losses = _Train(overrides, devices, engine)
  np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5,
                             err_msg=name)


@pytest.mark.e2e
def testLingvosMixedBucketsTrainAsTheSequentialModel(mt, shared_once):
  # GPipeMtBuckets: Train batch limits 8/6/4, each batch padded to 8 rows
  # (tasks/bucketed_input.py), its time axis the bucket's.
  del mt
  model = mt_testlib.BUCKETS_MODEL
  reference = shared_once('mt_buckets_sequential_losses',
                          lambda unused_path: _Train(_SEQUENTIAL, 1,
                                                     model=model))
  assert np.all(np.isfinite(reference))
  losses = _Train(['task.stack.schedule:"1f1b"'], 2, model=model)
  np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)
