"""A scaled-down GPipe Transformer NMT experiment, as Lingvo builds one.

The GPipe paper's NMT model is Lingvo's `GPipeTransformerModel(MTBaseModel)`
(in the history of Lingvo's `lingvo/tasks/mt/model.py`, not in the pip
package 0.14.2): a Transformer encoder-decoder on one
`layers_with_gpipe.GPipeTransformerStack` (time-major), Lingvo's `NmtInput`
and beam search. `_EXPERIMENT` writes that class with its methods as Lingvo
has them (`Params`, `CommonParams`, `__init__` and its enc/dec hooks,
`_PrepareInputs`, `FPropTower`, `DecoderComputePredictions`, `ExtendStep`,
the three beam-search callbacks, `_EncoderFPropDefaultTheta`,
`_DecoderBeamSearchDecode`), rewritten for this fixture rather than pasted,
and scaled down: only the time-major, dense path (no batch-major layers, MoE,
fixup init or transparent encoder; `CommonParams` keeps the arguments the
experiment sets). Its inputs and buckets are those of
`lingvo/tasks/mt/params/wmt14_en_de.py`'s `WmtEnDeTransformerBase` (NmtInput
on tfrecords of tf.Example source_id/source_padding/target_id/
target_padding/target_label/target_weight, a word-piece vocab; Train buckets
with mixed batch limits, Dev/Test `[16] * 8 + [4] * 2`) and its
`...CloudTpu` variant's static shapes (`pad_to_max_seq_length=True`,
`source_max_length` the last bucket, equal batch limits).

What 0.14.2 makes the copy change against Lingvo's class:

1. NmtInput's `tgt.ids` are int64 (only `src.ids`, `tgt.labels` are cast):
   `_PrepareInputs` casts the ids to int32 for the embedding lookup.
2. `__init__` creates `stack` without `tf.variable_scope(p.name)`: 0.14.2
   creates variables after `__init__`, under each child's own scope.
3. `MTBaseModel._BeamSearchDecode` is 0.14.2's (it has no
   `_ProcessBeamSearchDecodeOut`), so the class's `_BeamSearchDecode` and
   `_MaybeAppendAdditionalDecodingInputs` become `_AddExtraDecodingInfo`,
   installed as `dec.AddExtraDecodingInfo`, the hook 0.14.2's calls.
4. 0.14.2's `BeamSearchHelper` passes `cur_step` to the pre-step callback:
   `_PreBeamSearchStepCallback` takes it (the states count the steps).
5. `@base_layer.initializer` and `@inference_registry.AllowClassParams-
   Override` are gone: 0.14.2 has neither.
6. `Inference()` is left out: its `_InferenceSubgraph_Default`/`_Prod` are
   not in 0.14.2's `MTBaseModel` (mt_serving_testlib adds an `Inference()`).

Scaled down by class attributes only: `GPipeMt` (static batches, as the
CloudTpu variant), `GPipeMtBuckets` (Lingvo's mixed Train batch limits,
dynamic shapes, as WmtEnDeTransformerBase). The corpus is a "translation"
made from Python's own text (`pydoc_data.topics`): each target is its
source's words reversed. `Write(dir)` writes the tfrecords, the vocab and
the experiment module `lingvo_mt_gpipe.py`; the trainer runs `--model=MODEL`
with `dir` on PYTHONPATH (`Env`); `Register(dir)` imports it in-process.
"""

import collections
import os
import re

from tests.support import experiment_fixture
from tests.support import mt_experiment

MODULE = 'lingvo_mt_gpipe'
MODEL = MODULE + '.GPipeMt'
BUCKETS_MODEL = MODULE + '.GPipeMtBuckets'
# Lingvo's WMT'14 En->De tables (wmt14_en_de.py's WmtEnDeTransformerBase).
LINGVO_TRAIN_BOUNDS = (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80,
                       96)
LINGVO_TRAIN_LIMITS = (512, 409, 341, 292, 256, 204, 170, 146, 128, 102, 85,
                       73, 64, 51, 42)
LINGVO_EVAL_BOUNDS = (10, 14, 19, 26, 36, 50, 70, 98, 137, 200)
LINGVO_EVAL_LIMITS = (16,) * 8 + (4,) * 2
# The scaled-down copy: sentences of MIN_WORDS..MAX_WORDS words (+ </s>).
MIN_WORDS, MAX_WORDS = 2, 9
MAX_LENGTH = 10  # MAX_WORDS + </s>: the copy's source/target_max_length.
TRAIN_BOUNDS = (6, 8, 10)
TRAIN_LIMITS = (8, 6, 4)  # Mixed, as Lingvo's Train table.
EVAL_BOUNDS = (6, 10)
EVAL_LIMITS = (4, 4)
WORDS = 40  # Vocabulary words (the commonest of pydoc_data's).
SPECIALS = ('<unk>', '<s>', '</s>')  # Lingvo's tokenizer ids 0, 1, 2.
VOCAB_SIZE = 48  # len(SPECIALS) + WORDS, rounded up.
TRAIN_EXAMPLES, DEV_EXAMPLES, TEST_EXAMPLES = 600, 40, 40
WPM_SPACE = '\u2581'  # Word-piece's word start: wpm unsegmenting makes a space.



def Words():
  """The words of Python's own docs (pydoc_data.topics), lower case."""
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top
  text = ' '.join(pydoc_data.topics.topics.values()).lower()
  return re.sub(r'[^a-z ]', ' ', text).split()


def Vocab(words=None):
  """SPECIALS, then the WORDS commonest words as word pieces."""
  words = Words() if words is None else words
  common = [w for w, _ in collections.Counter(words).most_common(WORDS)]
  tokens = list(SPECIALS) + [WPM_SPACE + w for w in common]
  return tokens + ['<pad%d>' % i for i in range(VOCAB_SIZE - len(tokens))]


def Pairs(count, start=0, words=None):
  """`count` (source, target) word lists from the vocab's words in text order:
  MIN_WORDS..MAX_WORDS words each, the target the source reversed."""
  words = Words() if words is None else words
  known = set(Vocab(words))
  stream = [w for w in words if WPM_SPACE + w in known]
  span = MAX_WORDS - MIN_WORDS + 1
  pairs, i = [], start
  while len(pairs) < count:
    n = MIN_WORDS + (len(pairs) * 5) % span  # Lengths cycle over the range.
    src = stream[i:i + n]
    pairs.append((src, src[::-1]))
    i += n
  return pairs, i


def Example(src, tgt, ids):
  """One tf.Example as Lingvo's NmtInput reads it (its _DataSourceFromFile-
  Pattern): ids + </s> for source and labels, <s> + ids for target ids."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  sos, eos = SPECIALS.index('<s>'), SPECIALS.index('</s>')
  s = [ids[WPM_SPACE + w] for w in src] + [eos]
  t = [ids[WPM_SPACE + w] for w in tgt]

  def Ints(v):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=v))

  def Floats(v):
    return tf.train.Feature(float_list=tf.train.FloatList(value=v))

  return tf.train.Example(features=tf.train.Features(feature={
      'source_id': Ints(s),
      'source_padding': Floats([0.0] * len(s)),
      'target_id': Ints([sos] + t),
      'target_padding': Floats([0.0] * (len(t) + 1)),
      'target_label': Ints(t + [eos]),
      'target_weight': Floats([1.0] * (len(t) + 1)),
  })).SerializeToString()


def Write(root, train_shards=2):
  """Writes the tfrecords, the vocab and the experiment module in `root`;
  the data folder (the experiment's DATADIR)."""
  root = str(root)
  data = os.path.join(root, 'wmt14', 'wpm')
  os.makedirs(data, exist_ok=True)
  words = Words()
  tokens = Vocab(words)
  ids = {t: i for i, t in enumerate(tokens)}
  with open(os.path.join(data, 'wpm-ende.voc'), 'w') as f:
    f.write(''.join(f'{t}\t{i}\n' for i, t in enumerate(tokens)))
  at = 0
  per_shard = TRAIN_EXAMPLES // train_shards
  for shard in range(train_shards):
    pairs, at = Pairs(per_shard, at, words)
    _WriteRecords(os.path.join(
        data, f'train.tfrecords-{shard:05d}-of-{train_shards:05d}'), pairs,
                  ids)
  for name, count in (('dev', DEV_EXAMPLES), ('test', TEST_EXAMPLES)):
    pairs, at = Pairs(count, at, words)
    _WriteRecords(os.path.join(data, f'{name}.tfrecords'), pairs, ids)
  with open(os.path.join(root, MODULE + '.py'), 'w') as f:
    f.write(mt_experiment.EXPERIMENT % dict(
        lingvo_train_bounds=LINGVO_TRAIN_BOUNDS,
        lingvo_train_limits=LINGVO_TRAIN_LIMITS,
        lingvo_eval_bounds=LINGVO_EVAL_BOUNDS,
        lingvo_eval_limits=LINGVO_EVAL_LIMITS,
        datadir=data + os.sep, vocab_size=VOCAB_SIZE,
        train_bounds=TRAIN_BOUNDS, train_limits=TRAIN_LIMITS,
        eval_bounds=EVAL_BOUNDS, eval_limits=EVAL_LIMITS,
        train_samples=TRAIN_EXAMPLES, dev_samples=DEV_EXAMPLES,
        test_samples=TEST_EXAMPLES, max_length=MAX_LENGTH))
  return data


def _WriteRecords(path, pairs, ids):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.io.TFRecordWriter(path) as w:
    for src, tgt in pairs:
      w.write(Example(src, tgt, ids))


def Env(root, **extra):
  """The environment of a subprocess that runs the experiment in `root`."""
  return experiment_fixture.Env(root, **extra)


def Register(root):
  """Imports the experiment in-process (its classes register themselves)."""
  experiment_fixture.Register(root, MODULE)


def Fixture(tmp_path_factory):
  """A module fixture's body: the experiment's folder, written and
  registered in-process (`pytest.fixture(scope='module')(Fixture)`)."""
  yield from experiment_fixture.Fixture(tmp_path_factory, 'mt', Write, MODULE)
