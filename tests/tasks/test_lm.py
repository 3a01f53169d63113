"""Tests of the LM task's tokenizer, input generator and layer stack."""

import os

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.tasks.in_memory_input import InMemoryInput
from lingvo_ext.tasks.lm import input_generator
from lingvo_ext.tasks.lm import model
from lingvo_ext.tasks.lm import tokenizer

SEQ_LEN = 32
BATCH = 8


def _InputParams(split='train', **kwargs):
  p = input_generator.LmInput.Params().Set(
      split=split, seq_len=SEQ_LEN, batch_size=BATCH, **kwargs)
  if split != 'train':
    InMemoryInput.SetOnePass(p)
  return p


def _Instantiate(p, logdir=''):
  cluster = cluster_factory.Current().params.Copy()
  cluster.logdir = logdir
  with tf.Graph().as_default(), cluster_factory.Cluster(cluster):
    return p.Instantiate()


def testVocabIsDeterministicAndRankedByCount():
  text = 'abracadabra\n'
  vocab = tokenizer.Vocab.Build(text, 'char', 16)
  # a:5, b:2, r:2, c:1, d:1, \n:1; ties broken by the token.
  assert vocab.tokens == ['<pad>', '<unk>', 'a', 'b', 'r', '\n', 'c', 'd']
  assert vocab == tokenizer.Vocab.Build(text, 'char', 16)
  assert vocab.Decode(vocab.Encode(text)) == text
  small = tokenizer.Vocab.Build(text, 'char', 4)
  assert small.tokens == ['<pad>', '<unk>', 'a', 'b']
  assert small.Decode(small.Encode('abz')) == 'ab<unk>'


def testVocabSaveLoadRoundTrip(tmp_path):
  vocab = tokenizer.Vocab.Build('to be or not to be\n', 'word', 32)
  assert vocab.tokens[2:4] == ['be', 'to']
  path = str(tmp_path / 'vocab.json')
  vocab.Save(path)
  assert tokenizer.Vocab.Load(path) == vocab


def testBadTokenizerParams():
  with pytest.raises(ValueError, match='unit'):
    tokenizer.Tokenize('x', 'byte')
  with pytest.raises(ValueError, match='vocab_size'):
    tokenizer.Vocab.Build('abc', 'char', 2)


def testDefaultCorpusSplitsOnANewline():
  text = input_generator.ReadCorpus()
  assert 'The "if" statement' in text  # pydoc_data.topics' English text.
  train, dev = input_generator.SplitCorpus(text, 0.1)
  assert train + dev == text
  assert train.endswith('\n')
  assert 0.08 < len(dev) / len(text) < 0.12


def testMakeWindowsCoversEveryToken():
  ids = np.arange(1, 76, dtype=np.int32)  # 75 tokens, 74 targets.
  ex = input_generator.MakeWindows(ids, 10)
  assert ex.ids.shape == (8, 10)
  real = ex.weights > 0
  np.testing.assert_array_equal(ex.labels[real], ids[1:])
  np.testing.assert_array_equal(ex.ids[real], ids[:-1])
  assert ex.weights.sum() == 74


def testTrainInputIsDeterministicAndCoversTheSplit(tmp_path):
  inp = _Instantiate(_InputParams('train'), str(tmp_path))
  again = _Instantiate(_InputParams('train'), str(tmp_path))
  n = inp.num_examples
  steps = -(-n // BATCH)
  seen = []
  for step in range(steps):
    batch = inp.TrainBatchNp(step)
    other = again.TrainBatchNp(step)
    for k, v in batch.FlattenItems():
      np.testing.assert_array_equal(v, other.GetItem(k))
    seen.append(batch.example_ids)
  # One epoch of steps sees every window; the batch wraps round after.
  assert set(np.concatenate(seen).tolist()) == set(range(n))
  ids = inp.vocab.Encode(inp.SplitText('train'))
  ex = inp.Examples()
  np.testing.assert_array_equal(ex.labels[ex.weights > 0], ids[1:])


def testVocabIsSavedInLogdirAndReused(tmp_path):
  inp = _Instantiate(_InputParams('train'), str(tmp_path))
  path = os.path.join(str(tmp_path), 'train', 'vocab.json')
  assert inp.VocabPath() == path
  vocab = inp.vocab
  assert os.path.exists(path)
  # The dev input of the same logdir loads it instead of rebuilding.
  dev = _Instantiate(_InputParams('dev'), str(tmp_path))
  assert dev.vocab == vocab
  assert vocab.source == 'pydoc_data.topics'
  assert tokenizer.Vocab.Load(path).source == 'pydoc_data.topics'


def testStaleVocabOfAnotherTextIsAnError(tmp_path):
  # A run on a one-character text leaves its vocabulary in the logdir; a
  # later run on the default corpus must not reuse it (all would be <unk>).
  logdir = str(tmp_path / 'logdir')
  text_file = str(tmp_path / 'a.txt')
  with open(text_file, 'w') as f:
    f.write('a\n' * 50)
  tiny = _Instantiate(_InputParams('train', text_file=text_file), logdir)
  assert tiny.vocab.tokens[2:] == ['\n', 'a']
  path = os.path.join(logdir, 'train', 'vocab.json')
  with pytest.raises(ValueError) as e:
    _Instantiate(_InputParams('train'), logdir).vocab  # pylint: disable=expression-not-assigned
  msg = str(e.value)
  assert path in msg and text_file in msg and 'pydoc_data.topics' in msg
  assert 'Delete' in msg and '\n' not in msg


def testVocabMissingTrainTokensIsAnError(tmp_path):
  # A vocabulary without a recorded source (e.g. hand-written) is checked
  # against the tokens of the data.
  path = os.path.join(str(tmp_path), 'train', 'vocab.json')
  os.makedirs(os.path.dirname(path))
  with open(path, 'w') as f:
    f.write(tokenizer.Vocab(['x'], 'char', 128).ToJson())
  with pytest.raises(ValueError, match='missing from it') as e:
    _Instantiate(_InputParams('dev'), str(tmp_path)).vocab  # pylint: disable=expression-not-assigned
  assert path in str(e.value) and 'pydoc_data.topics' in str(e.value)


def testVocabMismatchIsAClearError(tmp_path):
  _Instantiate(_InputParams('train'), str(tmp_path)).vocab  # pylint: disable=expression-not-assigned
  bad = _Instantiate(_InputParams('train', vocab_size=64), str(tmp_path))
  with pytest.raises(ValueError, match='vocab_size'):
    bad.vocab  # pylint: disable=pointless-statement


def testDevInputIsOnePassOverTheWholeSplit(tmp_path):
  inp = _Instantiate(_InputParams('dev'), str(tmp_path))
  ids = inp.vocab.Encode(inp.SplitText('dev'))
  for _ in range(2):  # Reset() starts the pass again.
    inp.Reset()
    labels = []
    while True:
      try:
        batch = inp.NextEvalBatchNp()
      except StopIteration:
        break
      assert batch.ids.shape == (BATCH, SEQ_LEN)
      labels.append(batch.labels[batch.weights > 0])
    np.testing.assert_array_equal(np.concatenate(labels), ids[1:])


def testInputBatchInGraph(tmp_path):
  p = _InputParams('dev', text_file=str(tmp_path / 'corpus.txt'))
  with open(p.text_file, 'w') as f:
    f.write('one two three four\n' * 20 + 'dev dev dev\n' * 4)
  p.dev_fraction = 0.1
  with tf.Graph().as_default():
    py_utils.GetOrCreateGlobalStepVar()
    inp = p.Instantiate()
    batch = inp.GetPreprocessedInputBatch()
    assert batch.ids.shape.as_list() == [BATCH, SEQ_LEN]
    with tf.Session() as sess:
      got = sess.run(batch)
      with pytest.raises(tf.errors.OutOfRangeError):
        sess.run(batch)
      inp.Reset(sess)
      np.testing.assert_array_equal(sess.run(batch).ids, got.ids)
  dev = inp.SplitText('dev')
  assert set(dev.split()) == {'dev'} and dev.endswith('\n')
  # The inputs of the real targets are the whole split but its last token.
  assert inp.vocab.Decode(got.ids[got.weights > 0]) == dev[:-1]


def testMissingTextFileIsAClearError(tmp_path):
  inp = _Instantiate(_InputParams(text_file=str(tmp_path / 'none.txt')))
  with pytest.raises(ValueError, match='text_file'):
    inp.Examples()


def testLayerStackContract():
  from params import lm  # pylint: disable=g-import-not-at-top
  task = lm.TransformerLmTinyGPipe().Task()
  task.input = lm.TransformerLmTinyGPipe().Train()
  layers, shapes = model.TransformerLm.LayerStack(task)
  assert len(layers) == task.num_layers + 2
  assert [s.ToTensorShape().as_list() for s in shapes] == [[8, 32]]
  cells = gpipe.PartitionSequentialLayers(layers, task.num_partitions, *shapes)
  assert len(cells) == task.num_partitions == 2
  assert task.num_micro_batches == 2
  task.input = None
  with pytest.raises(ValueError, match='input'):
    model.TransformerLm.LayerStack(task)
