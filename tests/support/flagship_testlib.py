"""A scaled-down copy of Lingvo's flagship LM experiment, for the tests.

Lingvo's `lingvo/tasks/lm/params/one_billion_wds.py` defines
`OneBWdsGPipeTransformer`: a GPipe Transformer LM on the One Billion Words
layout (Train shards, held-out Dev and Test files, a word vocab file), with
its bucket tables (one Train bucket, nine Dev/Test buckets with batch limits
128/64/32/...), `fixed_input_shape=True` and `eval.samples_per_summary=0`.
The pip package of Lingvo 0.14.2 does not ship `lingvo.tasks.lm.params`, so
`_EXPERIMENT` restates that class (`OneBWdsGPipeTransformer`: the same
params, its tables as class attributes) and shrinks it by class attributes
only:

- `FlagshipTimeMajor`: the experiment as Lingvo writes it (time-major
  `FixedShapeInputLanguageModel`), scaled down;
- `Flagship`: the same on `BatchMajorLanguageModel` (the suggested fix);
- `FlagshipOneBucket`: `Flagship` with one-bucket Dev/Test inputs.

`Write(dir)` rebuilds the dataset layout from Python's own text
(`pydoc_data.topics`) and the experiment module `lingvo_flagship.py`, which
the trainer runs by `--model=lingvo_flagship.Flagship` with `dir` on
PYTHONPATH (`Env`). `Register(dir)` imports it in-process.
"""

import collections
import os
import re

from tests.support import experiment_fixture

MODULE = 'lingvo_flagship'
MODEL = MODULE + '.Flagship'
TIME_MAJOR_MODEL = MODULE + '.FlagshipTimeMajor'
ONE_BUCKET_MODEL = MODULE + '.FlagshipOneBucket'
# Lingvo's Dev/Test bucket table (upper bounds in characters, batch limits).
LINGVO_DEV_BOUNDS = (10, 20, 30, 40, 50, 100, 256, 512, 1024)
LINGVO_DEV_LIMITS = (128, 64, 32, 32, 16, 16, 4, 2, 1)
# The scaled-down copy's Dev/Test table: Lingvo's limits / 16 (at least 1).
DEV_LIMITS = tuple(max(1, b // 16) for b in LINGVO_DEV_LIMITS)
VOCAB_SIZE = 256

_EXPERIMENT = '''
"""Lingvo's OneBWdsGPipeTransformer, scaled down by class attributes."""
import os

from lingvo import model_registry
from lingvo.core import base_model_params
from lingvo.core import optimizer
from lingvo.core import schedule
from lingvo.core import tokenizers
from lingvo.tasks.lm import input_generator as lm_inp
from lingvo.tasks.lm import layers as lm_layers
from lingvo.tasks.lm import model


class OneBWdsGPipeTransformer(base_model_params.SingleTaskModelParams):
  """lingvo/tasks/lm/params/one_billion_wds.py's experiment, its values."""
  CORPUS_DIR = '/tmp/lm1b/1-billion-word-language-modeling-benchmark-r13output/'
  EMBEDDING_DIM = 1024
  VOCAB_SIZE = 793472  # includes <epsilon>
  WORD_VOCAB = os.path.join(CORPUS_DIR, 'vocab.txt')
  BATCH_SIZE = 8
  MAX_TOKENS = 128
  LAYERS = 6
  SPLITS = 1
  NUM_MICRO_BATCHES = 1
  NUM_HEADS = 16
  DEV_BUCKET_UPPER_BOUND = %(bounds)r
  DEV_BUCKET_BATCH_LIMIT = %(limits)r
  DEV_SAMPLES = 6206
  TEST_SAMPLES = 6075

  @classmethod
  def Train(cls):
    p = lm_inp.LmInput.Params()
    p.bucket_upper_bound = [cls.MAX_TOKENS]
    p.bucket_batch_limit = [cls.BATCH_SIZE]
    p.fixed_input_shape = True
    p.file_buffer_size = 10000000
    p.file_parallelism = 10
    p.file_pattern = 'text:' + os.path.join(
        cls.CORPUS_DIR, 'training-monolingual.tokenized.shuffled', 'news.en*')
    p.name = '1bwds_train_set'
    p.tokenizer = tokenizers.VocabFileTokenizer.Params()
    p.num_batcher_threads = 16
    p.target_max_length = cls.MAX_TOKENS
    p.tokenizer.target_sos_id = 1
    p.tokenizer.target_eos_id = 2
    p.tokenizer.target_unk_id = 3
    p.tokenizer.token_vocab_filepath = cls.WORD_VOCAB
    p.tokenizer.vocab_size = cls.VOCAB_SIZE
    return p

  @classmethod
  def Dev(cls):
    p = cls.Train()
    p.bucket_upper_bound = list(cls.DEV_BUCKET_UPPER_BOUND)
    p.bucket_batch_limit = list(cls.DEV_BUCKET_BATCH_LIMIT)
    p.file_buffer_size = 1
    p.file_parallelism = 1
    p.file_pattern = 'text:' + os.path.join(
        cls.CORPUS_DIR, 'heldout-monolingual.tokenized.shuffled',
        'news.en.heldout-00001*')
    p.name = '1bwds_dev_set'
    p.num_batcher_threads = 1
    p.num_samples = cls.DEV_SAMPLES
    return p

  @classmethod
  def Test(cls):
    p = cls.Dev()
    p.file_pattern = 'text:' + os.path.join(
        cls.CORPUS_DIR, 'heldout-monolingual.tokenized.shuffled',
        'news.en.heldout-00000*')
    p.name = '1bwds_test_set'
    p.num_samples = cls.TEST_SAMPLES
    return p

  @classmethod
  def Task(cls):
    p = model.FixedShapeInputLanguageModel.Params()
    p.eval.samples_per_summary = 0
    p.name = '1bwds_wpm_level_lm'
    p.lm = lm_layers.GPipeTransformerLm.CommonParams(
        model_dim=cls.EMBEDDING_DIM,
        vocab_size=cls.VOCAB_SIZE,
        hidden_dim=cls.EMBEDDING_DIM * 4,
        num_layers=cls.LAYERS,
        splits=cls.SPLITS,
        num_micro_batches=cls.NUM_MICRO_BATCHES,
        num_heads=cls.NUM_HEADS,
        softmax_max_alloc=128 * (2**20),
        atten_dropout_prob=0.1,
        residual_dropout_prob=0.1)
    p.train.Set(
        learning_rate=0.5,
        optimizer=optimizer.Adam.ParamsA(),
        clip_gradient_norm_to_value=0.0,
        grad_norm_to_clip_to_zero=0.0,
        lr_schedule=schedule.TransformerSchedule.Params().Set(
            warmup_steps=40000, worker_replicas=1,
            model_dim=cls.EMBEDDING_DIM))
    return p


@model_registry.RegisterSingleTaskModel
class FlagshipTimeMajor(OneBWdsGPipeTransformer):
  """The flagship as Lingvo writes it (time-major), scaled down."""
  CORPUS_DIR = %(corpus)r
  WORD_VOCAB = os.path.join(CORPUS_DIR, 'vocab.txt')
  EMBEDDING_DIM = 32
  VOCAB_SIZE = %(vocab_size)d
  BATCH_SIZE = 4
  MAX_TOKENS = 48
  LAYERS = 4
  SPLITS = 2
  NUM_MICRO_BATCHES = 2
  NUM_HEADS = 4
  DEV_BUCKET_BATCH_LIMIT = %(dev_limits)r
  DEV_SAMPLES = 40
  TEST_SAMPLES = 40

  @classmethod
  def Task(cls):
    p = super().Task()
    p.train.max_steps = 4
    p.train.save_interval_steps = 1000
    return p


@model_registry.RegisterSingleTaskModel
class Flagship(FlagshipTimeMajor):
  """The scaled-down flagship on BatchMajorLanguageModel (batch-major)."""

  @classmethod
  def Task(cls):
    p = super().Task()
    return model.BatchMajorLanguageModel.Params().Set(
        name=p.name, lm=p.lm, train=p.train, eval=p.eval)


@model_registry.RegisterSingleTaskModel
class FlagshipOneBucket(Flagship):
  """Flagship with one-bucket Dev and Test inputs (the longest bucket)."""
  DEV_BUCKET_UPPER_BOUND = (48,)
  DEV_BUCKET_BATCH_LIMIT = (4,)
'''


def Words():
  """The words of Python's own docs (pydoc_data.topics), lower case."""
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top
  text = ' '.join(pydoc_data.topics.topics.values()).lower()
  return re.sub(r'[^a-z ]', ' ', text).split()


def Sentences(words, count, start=0):
  """`count` lines of 3-47 words from `words` (Lingvo buckets them by their
  token count: the Dev/Test tables' first five buckets)."""
  lines, i = [], start
  while len(lines) < count:
    n = 3 + (len(lines) * 17) % 45  # Lengths cycle over 3..47 words.
    lines.append(' '.join(words[i:i + n]))
    i += n
  return lines, i


def Write(root, train_shards=3, lines_per_shard=200, heldout_lines=40):
  """Writes the dataset layout and the experiment module under `root`.

  Args:
    root: A directory (made if missing).
    train_shards: Train files (news.en-0000N-of-00100).
    lines_per_shard: Lines in each Train file.
    heldout_lines: Lines in the Dev and the Test file.

  Returns:
    The corpus directory.
  """
  root = str(root)
  corpus = os.path.join(root, 'lm1b')
  train_dir = os.path.join(corpus, 'training-monolingual.tokenized.shuffled')
  heldout = os.path.join(corpus, 'heldout-monolingual.tokenized.shuffled')
  os.makedirs(train_dir, exist_ok=True)
  os.makedirs(heldout, exist_ok=True)
  words = Words()
  at = 0
  for shard in range(train_shards):
    lines, at = Sentences(words, lines_per_shard, at)
    _WriteLines(os.path.join(train_dir, f'news.en-{shard + 1:05d}-of-00100'),
                lines)
  for shard in (1, 0):  # Dev: heldout-00001, Test: heldout-00000.
    lines, at = Sentences(words, heldout_lines, at)
    _WriteLines(os.path.join(
        heldout, f'news.en.heldout-{shard:05d}-of-00050'), lines)
  WriteVocab(os.path.join(corpus, 'vocab.txt'), words, VOCAB_SIZE)
  with open(os.path.join(root, MODULE + '.py'), 'w') as f:
    f.write(_EXPERIMENT % dict(
        bounds=LINGVO_DEV_BOUNDS, limits=LINGVO_DEV_LIMITS,
        dev_limits=DEV_LIMITS, corpus=corpus + os.sep,
        vocab_size=VOCAB_SIZE))
  return corpus


def WriteVocab(path, words, size):
  """A vocab file of `size` entries 'token<TAB>id': the 4 specials first."""
  specials = ['<epsilon>', '<S>', '</S>', '<UNK>']
  common = [w for w, _ in collections.Counter(words).most_common(
      size - len(specials))]
  _WriteLines(path, [f'{w}\t{i}' for i, w in enumerate(specials + common)])


def _WriteLines(path, lines):
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')


def Env(root, **extra):
  """The environment of a subprocess that runs the experiment in `root`."""
  return experiment_fixture.Env(root, **extra)


def Register(root):
  """Imports the experiment in-process (its classes register themselves)."""
  experiment_fixture.Register(root, MODULE)


def Fixture(tmp_path_factory):
  """A module fixture's body: the experiment's directory (for PYTHONPATH),
  written and registered in-process; off sys.path again after the module.

  Use as `flagship = pytest.fixture(scope='module')(flagship_testlib.Fixture)`.
  """
  yield from experiment_fixture.Fixture(tmp_path_factory, 'flagship', Write,
                                        MODULE)
