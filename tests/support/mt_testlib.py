"""A scaled-down GPipe Transformer NMT experiment, as Lingvo builds one.

The GPipe paper's NMT model is a Transformer encoder-decoder pipelined with
Lingvo's `layers_with_gpipe.GPipeTransformerStack` (encoder and decoder
layers in one stack, time-major). Lingvo's public history has no MT task
around that stack: none of the versions of `lingvo/tasks/mt/model.py` (nor
any commit under `lingvo/tasks/mt/`) defines a `GPipeTransformerModel`. So
`_EXPERIMENT` writes that task from Lingvo's own pieces, as an MT user on
the pip package 0.14.2 does:

- the inputs and buckets of `lingvo/tasks/mt/params/wmt14_en_de.py`'s
  `WmtEnDeTransformerBase` (Lingvo's `NmtInput` on tfrecords of tf.Example
  source_id/source_padding/target_id/target_padding/target_label/
  target_weight, a word-piece vocab; Train buckets with mixed batch limits,
  Dev/Test `[16] * 8 + [4] * 2`), and its `...CloudTpu` variant's static
  shapes (`pad_to_max_seq_length=True`, `source_max_length` the last bucket,
  equal batch limits);
- `MTBaseModel` (Lingvo's BLEU metrics and decode output) with the stack in
  place of its encoder and decoder children: the batch-major NmtInput batch
  transposed to the stack's time-major [time, batch] ids, as Lingvo's MT
  encoders do, and `BeamSearchHelper` decoding over the stack's encoder and
  decoder layers.

What 0.14.2 makes the copy change against Lingvo's MT code:

1. `MTBaseModel.__init__` creates `enc`/`dec` children: skipped, the task
   builds its one `stack` child (`BaseTask.__init__`).
2. NmtInput's `tgt.ids` are int64 (only `src.ids`, `tgt.labels` are cast):
   cast to int32 for the stack's embedding lookup.
3. `GPipeTransformerStack.FProp` returns per-token cross-entropies
   unweighted: the loss weights them by `tgt.weights` itself.
4. `_PostProcessBeamSearchDecodeOut` reads
   `p.decoder.beam_search.num_hyps_per_beam`: the copy reads
   `p.beam_search` (it has no decoder child).
5. The stack's decoder layers have no incremental `ExtendStep` over a
   pipeline: each beam-search step runs the decoder on the hypothesis'
   prefix (causal self-attention; the step's position is read out).
6. `BeamSearchHelper.BeamSearchDecode` needs `encoder_outputs.padding`
   [src_time, batch]: the encoder output is tiled per hypothesis the way
   Lingvo orders hypotheses (hyp i of beam i % num_beams).

Scaled down by class attributes only: `GPipeMt` (static batches, as the
CloudTpu variant), `GPipeMtBuckets` (Lingvo's mixed Train batch
limits, dynamic shapes, as WmtEnDeTransformerBase). The corpus is a "translation" made from
Python's own text (`pydoc_data.topics`): each target is its source's words
reversed. `Write(dir)` writes the tfrecords, the vocab and the experiment
module `lingvo_mt_gpipe.py`; the trainer runs `--model=MODEL` with `dir` on
PYTHONPATH (`Env`); `Register(dir)` imports it in-process.
"""

import collections
import os
import re
import sys

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

_EXPERIMENT = '''
"""A GPipe Transformer NMT experiment on Lingvo (tests/support/mt_testlib.py)."""
import os

import lingvo.compat as tf
from lingvo import model_registry
from lingvo.core import base_model
from lingvo.core import base_model_params
from lingvo.core import beam_search_helper
from lingvo.core import layers
from lingvo.core import layers_with_gpipe
from lingvo.core import optimizer
from lingvo.core import py_utils
from lingvo.core import schedule
from lingvo.tasks.mt import input_generator
from lingvo.tasks.mt import model as mt_model


class GPipeTransformerModel(mt_model.MTBaseModel):
  """Transformer NMT on one GPipeTransformerStack (time-major)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stack', layers_with_gpipe.GPipeTransformerStack.Params(),
             'The encoder-decoder stack, pipelined.')
    p.Define('beam_search', beam_search_helper.BeamSearchHelper.Params(),
             'Beam search decoding.')
    return p

  def __init__(self, params):
    base_model.BaseTask.__init__(self, params)  # Change 1: no enc/dec.
    p = self.params
    self.CreateChild('stack', p.stack)
    self.CreateChild('beam_search', p.beam_search)

  def ComputePredictions(self, theta, batch):
    src, tgt = batch.src, batch.tgt
    xent, logits = self.stack.FProp(
        theta.stack, tf.transpose(src.ids), tf.transpose(src.paddings),
        tf.transpose(tf.cast(tgt.ids, tf.int32)),  # Change 2.
        tf.transpose(tgt.paddings), labels=tf.transpose(tgt.labels),
        label_weights=tf.transpose(tgt.weights))
    return py_utils.NestedMap(per_token_xent=xent, logits=logits)

  def ComputeLoss(self, theta, predictions, input_batch):
    weights = tf.transpose(input_batch.tgt.weights)  # Change 3.
    num_tokens = tf.reduce_sum(weights)
    avg = tf.reduce_sum(predictions.per_token_xent * weights) / tf.maximum(
        num_tokens, 1.0)
    per_example = py_utils.NestedMap(
        xent=tf.reduce_sum(predictions.per_token_xent * weights, 0))
    return {'loss': (avg, num_tokens), 'log_pplx': (avg, num_tokens)}, (
        per_example)

  def _DecoderStep(self, encoder_outputs, prefix, t):
    """log-probs of each hypothesis' next token after prefix[:, :t + 1]."""
    stack = self.stack
    k = tf.shape(prefix)[0] // tf.shape(encoder_outputs.padding)[1]
    src = tf.tile(encoder_outputs.encoded, [1, k, 1])  # Change 6.
    src_paddings = tf.tile(encoder_outputs.padding, [1, k])
    ids = tf.transpose(prefix)
    vecs = stack.DecoderEmbedFPropDefaultTheta(ids)
    paddings = tf.zeros(tf.shape(ids), vecs.dtype)
    for dec in stack.GetDecoders():  # Change 5: the prefix, causally.
      vecs = dec.FProp(dec.theta, src, src_paddings, vecs, paddings, None,
                       None, None, None)[2]
    logits = stack.Logits(stack.theta, [tf.gather(vecs, t)])
    return tf.nn.log_softmax(logits)

  def _InitBeamSearchState(self, theta, encoder_outputs, num_hyps_per_beam):
    del theta
    src_time, num_beams = py_utils.GetShape(encoder_outputs.padding, 2)
    num_hyps = num_beams * num_hyps_per_beam
    steps = self.params.beam_search.target_seq_len
    return py_utils.NestedMap(
        log_probs=tf.zeros([num_hyps, self.params.stack.softmax_tpl.num_classes]),
        atten_probs=tf.zeros([num_hyps, src_time])), py_utils.NestedMap(
            prefix=tf.zeros([num_hyps, steps], tf.int32))

  def _PreBeamSearchStep(self, theta, encoder_outputs, step_ids, states,
                         num_hyps_per_beam, cur_step):
    del theta, num_hyps_per_beam
    steps = self.params.beam_search.target_seq_len
    prefix = states.prefix + step_ids * tf.one_hot(cur_step, steps,
                                                   dtype=tf.int32)[None, :]
    log_probs = self._DecoderStep(encoder_outputs, prefix, cur_step)
    src_time = tf.shape(encoder_outputs.padding)[0]
    return py_utils.NestedMap(
        log_probs=log_probs,
        atten_probs=tf.zeros([tf.shape(prefix)[0], src_time])), (
            py_utils.NestedMap(prefix=prefix))

  def _PostBeamSearchStep(self, theta, encoder_outputs, new_step_ids, states):
    return states

  def _BeamSearchDecode(self, input_batch):
    p = self.params
    with tf.name_scope('fprop'), tf.name_scope(p.name):
      src_ids = tf.transpose(input_batch.src.ids)
      src_paddings = tf.transpose(input_batch.src.paddings)
      encoded = self.stack.EncoderFPropDefaultTheta(
          self.stack.EncoderEmbedFPropDefaultTheta(src_ids), src_paddings)
      encoder_outputs = py_utils.NestedMap(encoded=encoded,
                                           padding=src_paddings)
      out = self.beam_search.BeamSearchDecode(
          self.theta, encoder_outputs,
          init_beam_search_state=self._InitBeamSearchState,
          pre_beam_search_step_callback=self._PreBeamSearchStep,
          post_beam_search_step_callback=self._PostBeamSearchStep)
      slen = tf.cast(tf.round(
          tf.reduce_sum(1 - input_batch.src.paddings, 1) - 1), tf.int32)
      srcs = self.input_generator.IdsToStrings(
          input_batch.src.ids, slen, self._GetTokenizerKeyToUse('src'))
      topk_decoded = self.input_generator.IdsToStrings(
          out.topk_ids, out.topk_lens - 1, self._GetTokenizerKeyToUse('tgt'))
      topk_decoded = tf.reshape(topk_decoded, tf.shape(out.topk_hyps))
      topk_scores = tf.reshape(out.topk_scores, tf.shape(out.topk_hyps))
      refs = self.input_generator.IdsToStrings(
          input_batch.tgt.labels,
          tf.cast(tf.round(
              tf.reduce_sum(1.0 - input_batch.tgt.paddings, 1) - 1.0),
                  tf.int32), self._GetTokenizerKeyToUse('tgt'))
      return {
          'target_ids': input_batch.tgt.ids,
          'target_labels': input_batch.tgt.labels,
          'target_weights': input_batch.tgt.weights,
          'target_paddings': input_batch.tgt.paddings,
          'sources': srcs,
          'targets': refs,
          'topk_decoded': topk_decoded,
          'topk_lens': out.topk_lens,
          'topk_scores': topk_scores,
      }

  def _PostProcessBeamSearchDecodeOut(self, dec_out_dict, dec_metrics_dict):
    unsegment = dec_metrics_dict['corpus_bleu'].unsegmenter
    targets = dec_out_dict['targets']
    dec_metrics_dict['num_samples_in_batch'].Update(len(targets))
    pairs = []
    for src, tgt, hyps, scores in zip(dec_out_dict['sources'], targets,
                                      dec_out_dict['topk_decoded'],
                                      dec_out_dict['topk_scores']):
      # Change 4: p.beam_search, not p.decoder.beam_search.
      assert len(hyps) == self.params.beam_search.num_hyps_per_beam
      dec_metrics_dict['corpus_bleu'].Update(tgt, hyps[0])
      pairs.append((unsegment(src), 'src: %%s tgt: %%s hyp0: %%s score0: %%f' %% (
          unsegment(src), unsegment(tgt), unsegment(hyps[0]), scores[0])))
    return pairs


class WmtEnDeGPipeTransformer(base_model_params.SingleTaskModelParams):
  """WmtEnDeTransformerBase's inputs, the Transformer on GPipe."""
  DATADIR = '/tmp/wmt14/wpm/'
  VOCAB_SIZE = 32000
  MODEL_DIM = 1024
  HIDDEN_DIM = 8192
  NUM_HEADS = 16
  ENCODER_LAYERS = 6
  DECODER_LAYERS = 6
  SPLITS = 4
  NUM_MICRO_BATCHES = 32
  DROPOUT = 0.1
  LABEL_SMOOTHING = 0.1
  LEARNING_RATE = 3.0
  WARMUP_STEPS = 40000
  MAX_STEPS = 1000000
  TRAIN_BOUNDS = %(lingvo_train_bounds)r
  TRAIN_LIMITS = %(lingvo_train_limits)r
  EVAL_BOUNDS = %(lingvo_eval_bounds)r
  EVAL_LIMITS = %(lingvo_eval_limits)r
  STATIC = False  # The CloudTpu variant's pad_to_max_seq_length.
  TRAIN_SAMPLES = 4492447
  DEV_SAMPLES = 3000
  TEST_SAMPLES = 2737
  BEAM = 4
  DECODE_LENGTH = 200

  def _CommonInputParams(self, is_eval):
    p = input_generator.NmtInput.Params()
    p.tokenizer.vocab_size = self.VOCAB_SIZE
    p.tokenizer.token_vocab_filepath = os.path.join(self.DATADIR,
                                                    'wpm-ende.voc')
    if is_eval:
      p.file_random_seed = 27182818
      p.file_parallelism = 1
      p.file_buffer_size = 1
      p.bucket_upper_bound = list(self.EVAL_BOUNDS)
      p.bucket_batch_limit = list(self.EVAL_LIMITS)
    else:
      p.file_random_seed = 0
      p.file_parallelism = 1
      p.file_buffer_size = 10000
      p.bucket_upper_bound = list(self.TRAIN_BOUNDS)
      p.bucket_batch_limit = list(self.TRAIN_LIMITS)
    if self.STATIC:
      p.pad_to_max_seq_length = True
      p.source_max_length = p.bucket_upper_bound[-1]
      p.target_max_length = p.bucket_upper_bound[-1]
      p.bucket_batch_limit = [max(p.bucket_batch_limit)] * len(
          p.bucket_upper_bound)
    p.num_batcher_threads = 1
    return p

  def Train(self):
    p = self._CommonInputParams(is_eval=False)
    p.file_pattern = 'tfrecord:' + os.path.join(self.DATADIR,
                                                'train.tfrecords-*')
    p.num_samples = self.TRAIN_SAMPLES
    return p

  def Dev(self):
    p = self._CommonInputParams(is_eval=True)
    p.file_pattern = 'tfrecord:' + os.path.join(self.DATADIR, 'dev.tfrecords')
    p.num_samples = self.DEV_SAMPLES
    return p

  def Test(self):
    p = self._CommonInputParams(is_eval=True)
    p.file_pattern = 'tfrecord:' + os.path.join(self.DATADIR,
                                                'test.tfrecords')
    p.num_samples = self.TEST_SAMPLES
    return p

  def Task(self):
    p = GPipeTransformerModel.Params()
    p.name = 'wmt14_en_de_gpipe_transformer'
    d = self.MODEL_DIM
    p.stack = layers_with_gpipe.GPipeTransformerStack.Params().Set(
        name='stack', model_dim=d, num_encoder_layers=self.ENCODER_LAYERS,
        num_decoder_layers=self.DECODER_LAYERS, splits=self.SPLITS,
        num_micro_batches=self.NUM_MICRO_BATCHES,
        state_dtype=tf.float32)  # As GPipeTransformerLm.CommonParams sets it.
    for t in (p.stack.encoder_tpl, p.stack.decoder_tpl):
      t.source_dim = d
      t.tr_atten_tpl.num_attention_heads = self.NUM_HEADS
      t.tr_atten_tpl.residual_dropout_prob = self.DROPOUT
      t.tr_atten_tpl.atten_dropout_prob = self.DROPOUT
      t.tr_fflayer_tpl.hidden_dim = self.HIDDEN_DIM
      t.tr_fflayer_tpl.residual_dropout_prob = self.DROPOUT
      t.tr_fflayer_tpl.relu_dropout_prob = self.DROPOUT
    p.stack.emb_tpl.token_emb.Set(vocab_size=self.VOCAB_SIZE,
                                  embedding_dim=d)
    p.stack.emb_tpl.position_emb.embedding_dim = d
    p.stack.emb_tpl.input_dropout_prob = self.DROPOUT
    p.stack.emb_tpl.max_seq_len = self.DECODE_LENGTH
    p.stack.softmax_tpl.Set(input_dim=d, num_classes=self.VOCAB_SIZE)
    if self.LABEL_SMOOTHING:
      p.stack.label_smoothing = layers.UniformLabelSmoother.Params().Set(
          num_classes=self.VOCAB_SIZE, uncertainty=self.LABEL_SMOOTHING)
    p.beam_search.Set(num_hyps_per_beam=self.BEAM,
                      target_seq_len=self.DECODE_LENGTH)
    p.train.Set(
        learning_rate=self.LEARNING_RATE,
        optimizer=optimizer.Adam.ParamsB(),
        clip_gradient_norm_to_value=0.0,
        grad_norm_to_clip_to_zero=0.0,
        max_steps=self.MAX_STEPS,
        lr_schedule=schedule.TransformerSchedule.Params().Set(
            warmup_steps=self.WARMUP_STEPS, worker_replicas=1, model_dim=d))
    p.eval.samples_per_summary = self.DEV_SAMPLES
    return p


@model_registry.RegisterSingleTaskModel
class GPipeMtBuckets(WmtEnDeGPipeTransformer):
  """Scaled down; Lingvo's mixed Train batch limits."""
  DATADIR = %(datadir)r
  VOCAB_SIZE = %(vocab_size)d
  MODEL_DIM = 16
  HIDDEN_DIM = 32
  NUM_HEADS = 2
  ENCODER_LAYERS = 2
  DECODER_LAYERS = 2
  SPLITS = 2
  NUM_MICRO_BATCHES = 2
  DROPOUT = 0.0
  LABEL_SMOOTHING = 0.0
  LEARNING_RATE = 1.0
  WARMUP_STEPS = 100
  MAX_STEPS = 4
  TRAIN_BOUNDS = %(train_bounds)r
  TRAIN_LIMITS = %(train_limits)r
  EVAL_BOUNDS = %(eval_bounds)r
  EVAL_LIMITS = %(eval_limits)r
  TRAIN_SAMPLES = %(train_samples)d
  DEV_SAMPLES = %(dev_samples)d
  TEST_SAMPLES = %(test_samples)d
  BEAM = 2
  DECODE_LENGTH = %(max_length)d

  def Task(self):
    p = super().Task()
    p.train.save_interval_steps = 1000
    return p


@model_registry.RegisterSingleTaskModel
class GPipeMt(GPipeMtBuckets):
  """Scaled down; static batches (the CloudTpu variant's)."""
  STATIC = True
'''


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
    f.write(_EXPERIMENT % dict(
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
  return dict(os.environ, PYTHONPATH=str(root), **extra)


def Register(root):
  """Imports the experiment in-process (its classes register themselves)."""
  if str(root) not in sys.path:
    sys.path.insert(0, str(root))
  from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
  registry.ImportModule(MODULE)


def Fixture(tmp_path_factory):
  """A module fixture's body: the experiment's folder, written and
  registered in-process (`pytest.fixture(scope='module')(Fixture)`)."""
  root = tmp_path_factory.mktemp('mt')
  Write(root)
  Register(root)
  yield root
  sys.path.remove(str(root))
