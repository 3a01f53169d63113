"""Pipelined Transformer LM experiments on a text corpus.

The default corpus is the English text of pydoc_data.topics (ships with
Python); point the input's text_file at any UTF-8 text to train on it, e.g.
--model_params_override='input.text_file:/path/corpus.txt' (the dev split is
then cut from the same file; `task.input.text_file` is accepted too).
"""

from lingvo import model_registry

from lingvo_ext.tasks.lm import input_generator
from lingvo_ext.tasks.lm import model
from params import base


class _TransformerLmBase(base.PipelinedExperiment):
  """Shared structure; the registered classes below set the sizes."""

  TEXT_FILE = ''  # Empty: pydoc_data.topics.
  UNIT = 'char'
  VOCAB_SIZE = 128
  SEQ_LEN = 128
  BATCH_SIZE = 32
  MODEL_DIM = 128
  NUM_HEADS = 4
  HIDDEN_DIM = 512
  NUM_LAYERS = 4
  LEARNING_RATE = 1e-3
  MAX_STEPS = 5000
  PARTITIONER = None  # See TransformerLm.partitioner.

  def _InputParams(self, split):
    return input_generator.LmInput.Params().Set(
        text_file=self.TEXT_FILE,
        split=split,
        unit=self.UNIT,
        vocab_size=self.VOCAB_SIZE,
        seq_len=self.SEQ_LEN,
        batch_size=self.BATCH_SIZE)

  def _TaskParams(self):
    return model.TransformerLm.Params().Set(
        name='lm',
        vocab_size=self.VOCAB_SIZE,
        model_dim=self.MODEL_DIM,
        num_heads=self.NUM_HEADS,
        hidden_dim=self.HIDDEN_DIM,
        num_layers=self.NUM_LAYERS,
        partitioner=self.PARTITIONER)


@model_registry.RegisterSingleTaskModel
class TransformerLm(_TransformerLmBase):
  """The default: a 4-layer, 128-wide character LM, one pipeline cell."""


@model_registry.RegisterSingleTaskModel
class TransformerLmGPipe(TransformerLm):
  """TransformerLm cut into 2 cells over 4 micro-batches.

  Run the cells in parallel with --num_cpu_devices=2 --worker_split_size=2
  (or --worker_gpus=2 --worker_split_size=2 on GPUs).
  """
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 4


@model_registry.RegisterSingleTaskModel
class TransformerLmTiny(_TransformerLmBase):
  """A 2-layer, 32-wide LM whose loss falls within seconds on a CPU."""
  SEQ_LEN = 32
  BATCH_SIZE = 8
  MODEL_DIM = 32
  NUM_HEADS = 2
  HIDDEN_DIM = 64
  NUM_LAYERS = 2
  LEARNING_RATE = 3e-3
  MAX_STEPS = 30
  # The controller checks for the end of training this often, too.
  SAVE_INTERVAL_SECONDS = 5
  SUMMARY_INTERVAL_STEPS = 10


@model_registry.RegisterSingleTaskModel
class TransformerLmTinyGPipe(TransformerLmTiny):
  """TransformerLmTiny in 2 cells over 2 micro-batches (same variables)."""
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 2


# Word-level LMs. The train split of pydoc_data.topics has 4031 distinct
# words; VOCAB_SIZE = 4096 keeps every one of them (with <pad> and <unk>).
# The embedding and the softmax hold most of the parameters, so they are what
# partitioning spreads over devices. On a user's corpus (task.input.text_file)
# raise task.vocab_size and task.input.vocab_size together.


class _WordLmBase(_TransformerLmBase):
  UNIT = 'word'
  VOCAB_SIZE = 4096
  SEQ_LEN = 64
  BATCH_SIZE = 16
  MODEL_DIM = 256
  NUM_HEADS = 4
  HIDDEN_DIM = 512
  NUM_LAYERS = 2
  MAX_STEPS = 3000


@model_registry.RegisterSingleTaskModel
class WordLm(_WordLmBase):
  """A 2-layer, 256-wide word LM over a 4096-word vocabulary, unpartitioned."""


@model_registry.RegisterSingleTaskModel
class WordLmSharded(WordLm):
  """WordLm with its embedding and softmax in 4 shards ('div').

  Shard i lives on device i mod S of the model split: run with
  --num_cpu_devices=4 --worker_split_size=4 to put one shard on each (or on
  the ps tasks of a cluster with a ps job). Checkpoints of WordLm and
  WordLmSharded restore into each other.
  """
  PARTITIONER = ('fixed_size', dict(num_shards=4))


@model_registry.RegisterSingleTaskModel
class WordLmTiny(_WordLmBase):
  """A 1-layer, 32-wide word LM (4096 words) that trains in seconds."""
  SEQ_LEN = 32
  BATCH_SIZE = 8
  MODEL_DIM = 32
  NUM_HEADS = 2
  HIDDEN_DIM = 64
  NUM_LAYERS = 1
  LEARNING_RATE = 3e-3
  MAX_STEPS = 30
  SAVE_INTERVAL_SECONDS = 5
  SUMMARY_INTERVAL_STEPS = 10


@model_registry.RegisterSingleTaskModel
class WordLmShardedTiny(WordLmTiny):
  """WordLmTiny with its embedding and softmax in 4 shards ('div')."""
  PARTITIONER = ('fixed_size', dict(num_shards=4))
