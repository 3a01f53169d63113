"""The source of the MT fixture's experiment module (`lingvo_mt_gpipe.py`),
a template mt_testlib.Write fills in: Lingvo's GPipeTransformerModel and
the WMT'14 En-De params, scaled down (mt_testlib's docstring says how).
"""

# pylint: disable=line-too-long
EXPERIMENT = '''
"""A GPipe Transformer NMT experiment on Lingvo (tests/support/mt_testlib)."""
import math
import os

import lingvo.compat as tf
from lingvo import model_registry
from lingvo.core import base_decoder
from lingvo.core import base_layer
from lingvo.core import base_model_params
from lingvo.core import layers
from lingvo.core import layers_with_gpipe
from lingvo.core import optimizer
from lingvo.core import py_utils
from lingvo.core import schedule
from lingvo.tasks.mt import input_generator
from lingvo.tasks.mt import model as mt_model


class GPipeTransformerModel(mt_model.MTBaseModel):
  """Lingvo's Transformer NMT on GPipe: one GPipeTransformerStack."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stack', layers_with_gpipe.GPipeTransformerStack.Params(),
             'The encoder-decoder GPipeTransformerStack.')
    p.Define('init_decoder_step_ids', False,
             'Beam search starts from the first target id, not <s>.')
    p.Define('use_task_ids', False, 'The input batch carries task ids.')
    # MTBaseModel's enc/dec: stand-ins whose methods run the stack.
    p.encoder = base_layer.BaseLayer.Params()
    p.encoder.Define('packed_input', False, 'Unused; read by MTBaseModel.')
    p.decoder = base_decoder.BaseBeamSearchDecoder.Params()
    p.decoder.beam_search.batch_major_state = False
    return p

  @classmethod
  def CommonParams(cls, vocab_size, model_dim, hidden_dim=1024, num_heads=8,
                   num_layers=6, num_micro_batches=1, num_shards=16,
                   input_dropout_prob=0.0, residual_dropout_prob=0.1,
                   atten_dropout_prob=0.0, relu_dropout_prob=0.0,
                   label_smoothing_uncertainty=0.1, splits=1,
                   num_encoder_layers=None, num_decoder_layers=None):
    """Lingvo's Transformer setup of the stack (time-major, dense)."""
    p = cls.Params()
    p.name = 'transformer'
    no_vn = py_utils.VariationalNoiseParams(1.0, False, False)
    xavier = py_utils.WeightInit.Xavier(1.0)
    emb_init = py_utils.WeightInit.Gaussian(1.0 / math.sqrt(model_dim))

    emb = p.stack.emb_tpl
    emb.token_emb.Set(use_matmul=True, use_3d_weight_tensor=False,
                      vocab_size=vocab_size, embedding_dim=model_dim,
                      params_init=emb_init, vn=no_vn)
    emb.target_vocab_size = vocab_size
    emb.position_emb.Set(embedding_dim=model_dim, trainable_scaling=False,
                         vn=no_vn)
    emb.input_dropout_prob = input_dropout_prob

    p.stack.Set(model_dim=model_dim, splits=splits,
                num_micro_batches=num_micro_batches,
                num_encoder_layers=num_encoder_layers or num_layers,
                num_decoder_layers=num_decoder_layers or num_layers)
    enc = p.stack.encoder_tpl
    enc.source_dim = model_dim
    enc.has_aux_atten = False
    enc.tr_atten_tpl.Set(
        source_dim=model_dim, num_attention_heads=num_heads,
        residual_dropout_prob=residual_dropout_prob,
        atten_dropout_prob=atten_dropout_prob, params_init=xavier, vn=no_vn)
    enc.tr_atten_tpl.atten_tpl.Set(
        num_attention_heads=num_heads, enable_ctx_pre_proj=True,
        enable_ctx_post_proj=True, context_dim=model_dim, vn=no_vn)
    enc.tr_fflayer_tpl.Set(
        input_dim=model_dim, hidden_dim=hidden_dim,
        residual_dropout_prob=residual_dropout_prob,
        relu_dropout_prob=relu_dropout_prob, params_init=xavier, vn=no_vn)
    p.stack.decoder_tpl = enc.Copy().Set(has_aux_atten=True,
                                         mask_self_atten=True)

    p.stack.softmax_tpl.Set(input_dim=model_dim, num_classes=vocab_size,
                            num_shards=num_shards, params_init=emb_init)
    if label_smoothing_uncertainty > 0:
      p.stack.label_smoothing = layers.UniformLabelSmoother.Params().Set(
          num_classes=vocab_size, uncertainty=label_smoothing_uncertainty)
    p.decoder.target_seq_len = 300
    p.decoder.beam_search.Set(length_normalization=0.5, coverage_penalty=0.0)
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    p.stack.packed_input = p.stack.packed_input and not self.do_eval
    p.stack.state_dtype = p.fprop_dtype or p.dtype
    emb_p = p.stack.emb_tpl
    assert emb_p.target_vocab_size == p.stack.softmax_tpl.num_classes
    assert emb_p.token_emb.embedding_dim == emb_p.position_emb.embedding_dim
    self.enc.FPropDefaultTheta = self._EncoderFPropDefaultTheta
    self.dec.AddExtraDecodingInfo = self._AddExtraDecodingInfo  # Change 3.
    self.dec.BeamSearchDecode = self._DecoderBeamSearchDecode
    self.dec.ComputePredictions = self.DecoderComputePredictions
    self.dec.ExtendStep = self.ExtendStep
    self.CreateChild('stack', p.stack)  # Change 2: no variable_scope.

  def _PrepareInputs(self, input_batch):
    """(ids, paddings, segment ids, segment pos, task ids), time-major."""
    p = self.params
    paddings = input_batch.paddings
    ids = py_utils.with_dependencies([
        py_utils.assert_shape_match(
            tf.shape(input_batch.ids), tf.shape(paddings)),
        py_utils.assert_equal(tf.rank(input_batch.ids), 2)
    ], tf.cast(input_batch.ids, tf.int32))  # Change 1.
    segment_ids = segment_pos = task_ids = None
    if p.stack.packed_input:
      segment_ids = input_batch.segment_ids
      segment_pos = input_batch.segment_pos
    if p.use_task_ids:
      task_ids = input_batch.task_ids
    if p.stack.batch_dim:  # Time-major: [time, batch].
      ids, paddings, segment_ids, segment_pos, task_ids = [
          None if t is None else tf.transpose(t)
          for t in (ids, paddings, segment_ids, segment_pos, task_ids)]
    return ids, paddings, segment_ids, segment_pos, task_ids

  def FPropTower(self, theta, input_batch):
    """The stack's loss on one tower's batch: (metrics, per-example loss)."""
    p = self.params
    with tf.name_scope(p.name):
      src_ids, src_paddings, src_seg_ids, src_seg_pos, src_task_ids = (
          self._PrepareInputs(input_batch.src))
      tgt_ids, tgt_paddings, tgt_seg_ids, tgt_seg_pos, tgt_task_ids = (
          self._PrepareInputs(input_batch.tgt))
      labels, weights = input_batch.tgt.labels, input_batch.tgt.weights
      if p.stack.batch_dim:
        labels, weights = tf.transpose(labels), tf.transpose(weights)
      xent, logits = self.stack.FProp(
          theta.stack, src_ids, src_paddings, tgt_ids, tgt_paddings,
          src_seg_ids, tgt_seg_ids, labels, weights, src_seg_pos,
          tgt_seg_pos, src_task_ids, tgt_task_ids)
      total_weights = tf.reduce_sum(weights)
      loss = tf.reduce_sum(xent * weights) / total_weights
    metrics = {'loss': (loss, total_weights),
               'log_pplx': (loss, total_weights)}
    per_example = {'loss': tf.reduce_sum(xent * weights, 0)}
    if self.do_eval:
      correct = tf.cast(tf.equal(
          tf.cast(tf.argmax(logits, 2), tf.int32), labels), p.dtype)
      accuracy = tf.identity(
          tf.reduce_sum(correct * weights) / total_weights,
          name='fraction_of_correct_next_step_preds')
      metrics['fraction_of_correct_next_step_preds'] = (accuracy,
                                                        total_weights)
    return metrics, per_example

  def DecoderComputePredictions(self, theta, encoder_outputs, targets):
    """The decoder layers' outputs on `targets`, outside the pipeline."""
    tgt_ids, tgt_paddings, tgt_seg_ids, _, tgt_task_ids = (
        self._PrepareInputs(targets))
    vecs = self.stack.DecoderEmbedFPropDefaultTheta(tgt_ids, tgt_task_ids)
    for dec in self.stack.GetDecoders():
      vecs = dec.FProp(dec.theta, encoder_outputs.encoded,
                       encoder_outputs.padding, vecs, tgt_paddings,
                       encoder_outputs.get('segment_id'), tgt_seg_ids, None,
                       None)[2]
    return vecs

  def _AddExtraDecodingInfo(self, encoder_outputs, targets):
    """Task ids and first target ids for beam search, if asked for."""
    p = self.params
    if p.use_task_ids:
      encoder_outputs['task_ids'] = tf.tile(
          targets.task_ids[:, 0], [p.decoder.beam_search.num_hyps_per_beam])
    if p.init_decoder_step_ids:
      encoder_outputs['init_step_ids'] = targets.ids[:, 0]
    return encoder_outputs

  def ExtendStep(self, theta, encoder_outputs, new_ids, t, prefix_states):
    """One decoding step of every decoder layer (time-major)."""
    p = self.params
    out_states = prefix_states.Pack(prefix_states.Flatten())
    task_ids = encoder_outputs.task_ids if p.use_task_ids else None
    vecs = self.stack.DecoderEmbedFPropDefaultTheta(new_ids, task_ids, t)
    tpu = p.decoder.beam_search.name == 'tpu_beam_search'
    for i, dec in enumerate(self.stack.GetDecoders()):
      key = 'decoder_%%d' %% i
      vecs, _, out_states[key] = dec.ExtendStep(
          dec.theta, vecs, prefix_states[key], encoder_outputs.encoded,
          encoder_outputs.padding, t if tpu else None)
    return vecs, out_states

  def _InitBeamSearchStateCallback(self, theta, encoder_outputs,
                                   num_hyps_per_beam):
    """Zero log-probs, uniform attention, empty key/value prefixes."""
    p = self.params
    dtype = py_utils.FPropDtype(p)
    src_time, src_batch = py_utils.GetShape(encoder_outputs.encoded)[:2]
    num_hyps = src_batch * num_hyps_per_beam
    results = py_utils.NestedMap(
        log_probs=tf.zeros([num_hyps, p.stack.softmax_tpl.num_classes],
                           dtype=dtype),
        atten_probs=tf.ones([num_hyps, src_time], dtype=dtype) / tf.cast(
            src_time, dtype))
    if p.init_decoder_step_ids:
      results['step_ids'] = tf.expand_dims(
          tf.tile(encoder_outputs.init_step_ids, [num_hyps_per_beam]), 1)
    dim = (p.stack.decoder_tpl.tr_atten_tpl.atten_hidden_dim or
           p.stack.model_dim)
    seq_len = (p.decoder.target_seq_len
               if p.decoder.beam_search.name == 'tpu_beam_search' else 0)
    prefix_states = py_utils.NestedMap({
        'decoder_%%d' %% i: py_utils.NestedMap(
            key=tf.zeros([seq_len, num_hyps, dim], dtype=dtype),
            value=tf.zeros([seq_len, num_hyps, dim], dtype=dtype))
        for i in range(p.stack.num_decoder_layers)
    })
    return results, py_utils.NestedMap(prefix_states=prefix_states,
                                       time_step=tf.constant(0))

  def _PreBeamSearchStepCallback(self, theta, encoder_outputs, step_ids,
                                 states, num_hyps_per_beam, cur_step=None):
    """Next-token log-probs of each hypothesis, states one step on."""
    del num_hyps_per_beam, cur_step  # Change 4: states count the steps.
    p = self.params
    t = states.time_step
    new_states = states.Pack(states.Flatten())
    vecs, new_states.prefix_states = self.ExtendStep(
        theta, encoder_outputs, tf.squeeze(step_ids, 1), t,
        states.prefix_states)
    new_states.time_step = t + 1
    logits = self.stack.Logits(
        theta.stack, [tf.reshape(vecs, [-1, p.stack.softmax_tpl.input_dim])])
    dtype = py_utils.FPropDtype(p)
    src_time = py_utils.GetShape(encoder_outputs.encoded)[0]
    num_hyps = py_utils.GetShape(step_ids)[0]
    return py_utils.NestedMap(
        log_probs=tf.nn.log_softmax(logits),
        atten_probs=tf.ones([num_hyps, src_time], dtype=dtype) / tf.cast(
            src_time, dtype)), new_states

  def _PostBeamSearchStepCallback(self, theta, encoder_outputs, new_step_ids,
                                  states):
    return states

  def _EncoderFPropDefaultTheta(self, input_batch):
    ids, paddings, _, _, task_ids = self._PrepareInputs(input_batch)
    encoded = self.stack.EncoderFPropDefaultTheta(
        self.stack.EncoderEmbedFPropDefaultTheta(ids, task_ids), paddings)
    return py_utils.NestedMap(encoded=encoded, padding=paddings)

  def _DecoderBeamSearchDecode(self, encoder_outputs,
                               num_hyps_per_beam_override=0):
    return self.dec.beam_search.BeamSearchDecode(
        self.theta, encoder_outputs, num_hyps_per_beam_override,
        self._InitBeamSearchStateCallback, self._PreBeamSearchStepCallback,
        self._PostBeamSearchStepCallback)


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
  NUM_SHARDS = 16
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
    p = GPipeTransformerModel.CommonParams(
        vocab_size=self.VOCAB_SIZE, model_dim=self.MODEL_DIM,
        hidden_dim=self.HIDDEN_DIM, num_heads=self.NUM_HEADS,
        num_micro_batches=self.NUM_MICRO_BATCHES, num_shards=self.NUM_SHARDS,
        input_dropout_prob=self.DROPOUT, residual_dropout_prob=self.DROPOUT,
        atten_dropout_prob=self.DROPOUT, relu_dropout_prob=self.DROPOUT,
        label_smoothing_uncertainty=self.LABEL_SMOOTHING, splits=self.SPLITS,
        num_encoder_layers=self.ENCODER_LAYERS,
        num_decoder_layers=self.DECODER_LAYERS)
    p.name = 'wmt14_en_de_gpipe_transformer'
    p.stack.emb_tpl.max_seq_len = self.DECODE_LENGTH
    p.decoder.target_seq_len = self.DECODE_LENGTH
    p.decoder.beam_search.num_hyps_per_beam = self.BEAM
    p.train.Set(
        learning_rate=self.LEARNING_RATE,
        optimizer=optimizer.Adam.ParamsB(),
        clip_gradient_norm_to_value=0.0,
        grad_norm_to_clip_to_zero=0.0,
        max_steps=self.MAX_STEPS,
        lr_schedule=schedule.TransformerSchedule.Params().Set(
            warmup_steps=self.WARMUP_STEPS, worker_replicas=1,
            model_dim=self.MODEL_DIM))
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
  NUM_SHARDS = 1
  NUM_MICRO_BATCHES = 2
  DROPOUT = 0.0
  LABEL_SMOOTHING = 0.0
  LEARNING_RATE = 0.5
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
