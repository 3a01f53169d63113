"""Lingvo's own GPipe Transformer LM as a user's experiment module.

`Write(folder)` writes it (`lingvo_gpipe_lm.py`, registering MODEL, its
time-major twin MODEL + 'TimeMajor' and UNTRIMMED_MODEL) and its text data
into folder, for
PYTHONPATH: Lingvo's `BatchMajorLanguageModel` with
`GPipeTransformerLm.CommonParams(...)` (2 cells, 4 micro-batches), fed by
Lingvo's `LmInput` on a text file (LINGVO_GPIPE_LM_DATA overrides the file).
tests/tasks/test_lingvo_models.py and tests/serving/test_serving.py run it;
conftest.py's lingvo_lm_run is one trained run of it that both share.
"""

import os
import re

MODEL = 'lingvo_gpipe_lm.GPipeLm'
# bench/lingvo_lm.py's: the task keeps the input's fixed length, as Lingvo
# does on TPU, so that Lingvo's own engine builds its pipeline off TPU too.
UNTRIMMED_MODEL = MODEL + 'Untrimmed'

EXPERIMENT = '''
"""Lingvo's own GPipe Transformer LM, as a Lingvo user writes it."""
import os
from lingvo import model_registry
from lingvo.core import base_model_params
from lingvo.core import optimizer
from lingvo.core import schedule
from lingvo.tasks.lm import input_generator
from lingvo.tasks.lm import layers
from lingvo.tasks.lm import model


def _Input():
  p = input_generator.LmInput.Params()
  p.file_pattern = 'text:' + os.environ.get('LINGVO_GPIPE_LM_DATA', %r)
  p.file_random_seed = 301
  p.file_parallelism = 1
  p.file_buffer_size = 100
  p.num_batcher_threads = 1
  p.bucket_upper_bound = [16]
  p.bucket_batch_limit = [8]
  p.target_max_length = 16
  p.fixed_input_shape = True  # The pipeline splits the batch statically.
  p.tokenizer.vocab_size = 128
  return p


@model_registry.RegisterSingleTaskModel
class GPipeLm(base_model_params.SingleTaskModelParams):

  def Train(self):
    return _Input()

  def Dev(self):
    return _Input()

  def Task(self):
    p = model.BatchMajorLanguageModel.Params()
    p.name = 'lm'
    p.lm = layers.GPipeTransformerLm.CommonParams(
        vocab_size=128, model_dim=64, hidden_dim=128, num_heads=2,
        num_layers=4, splits=2, num_micro_batches=4)
    p.train.learning_rate = 1e-3
    p.train.optimizer = optimizer.Adam.Params()
    p.train.lr_schedule = schedule.ConstantOne.Params()
    p.train.max_steps = 2
    p.train.save_interval_steps = 1000
    return p


class UntrimmedLm(model.BatchMajorLanguageModel):
  """Keeps the input's fixed length (Lingvo off TPU trims it to the batch's
  longest sentence, a length its own engine cannot pipeline)."""

  def _TrimIfPossible(self, ids, paddings, labels, weights):
    return ids, paddings, labels, weights


@model_registry.RegisterSingleTaskModel
class GPipeLmUntrimmed(GPipeLm):

  def Task(self):
    p = super().Task()
    return UntrimmedLm.Params().Set(name='lm', lm=p.lm, train=p.train)


@model_registry.RegisterSingleTaskModel
class GPipeLmTimeMajor(GPipeLm):

  def Task(self):
    p = super().Task()
    lm = p.lm
    p = model.LanguageModel.Params().Set(name='lm', lm=lm, train=p.train)
    return p
'''


def Text():
  """Lines of 8 words from the Python docs' topics (offline data)."""
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top
  words = re.sub(r'[^a-z ]', ' ', ' '.join(
      pydoc_data.topics.topics.values()).lower()).split()
  return '\n'.join(' '.join(words[i:i + 8]) for i in range(0, 4000, 8)) + '\n'


def Write(folder):
  """Writes the experiment module and its data into folder; folder."""
  folder = str(folder)
  os.makedirs(folder, exist_ok=True)
  data = os.path.join(folder, 'train.txt')
  with open(data, 'w') as f:
    f.write(Text())
  with open(os.path.join(folder, 'lingvo_gpipe_lm.py'), 'w') as f:
    f.write(EXPERIMENT % data)
  return folder
