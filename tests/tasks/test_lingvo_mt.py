"""A GPipe Transformer NMT experiment on Lingvo (tests/support/mt_testlib.py).

In process: the copy keeps Lingvo's tables scaled down; NmtInput reads its
tfrecords (the reversed-word corpus) as Lingvo builds them; every schedule
trains as the sequential model does.
"""

import lingvo_ext  # pylint: disable=unused-import
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
