"""A GPipe-pipelined Transformer language model.

The whole stack (embedding, num_layers Transformer layers, softmax) is one
flat list of layers. `PartitionSequentialLayers` cuts it into num_partitions
cells of balanced cost and a `PipeliningLayer` runs the cells over
num_micro_batches micro-batches, cell i on device i of the model split
(--worker_split_size devices; with one device the cells run in sequence).
Variable names do not depend on num_partitions, so checkpoints move between
partitionings.

Its decoder (--job=decoder_dev) samples continuations of dev prefixes: the
first decode_prefix_len tokens of each dev window are kept, the rest sampled
token by token (greedy with decode_temperature=0), each new token one
position through the stack from the cached keys and values (generate.py).
The samples go to
<logdir>/decoder_dev/samples-<step>.txt and to TensorBoard's Text tab (tag
`samples`).

Its inference subgraphs (`Inference()`, Lingvo's form; docs/serving.md):
`default` scores given ids, `generate` continues a prefix with the same
token choice as the decoder (`NextToken`).
"""

import lingvo.compat as tf
from lingvo.core import metrics as metrics_lib
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_ext import layers
from lingvo_ext.tasks import decoding
from lingvo_ext.tasks import pipelined_task
from lingvo_ext.tasks.lm import generate

# The token choice the decoder and `generate` share (its home is generate.py).
NextToken = generate.NextToken


class TransformerLm(pipelined_task.PipelinedTask):
  """Causal Transformer LM reporting per-token log-perplexity (log_pplx)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 128,
             'Vocabulary size; must equal the input generator\'s.')
    p.Define('model_dim', 64, 'Model depth.')
    p.Define('num_heads', 4, 'Attention heads; must divide model_dim.')
    p.Define('hidden_dim', 256, 'Feed-forward hidden depth.')
    p.Define('num_layers', 2, 'Number of Transformer layers.')
    p.Define(
        'position_embedding', 'LEARNED',
        'Position embedding of the EmbeddingLayer: LEARNED, SINUSOIDAL or '
        'NONE.')
    p.Define(
        'partitioner', None, 'Partitioning of the token embedding and the '
        'softmax along the vocabulary (EmbeddingLayer.partitioner and '
        "SoftmaxLayer.partitioner), e.g. ('fixed_size', dict(num_shards=4)); "
        'None: unpartitioned.')
    p.Define(
        'partition_strategy', 'div', "'div' or 'mod': how token ids map to "
        'shards (EmbeddingLayer.partition_strategy).')
    p.Define(
        'decode_prefix_len', 0, 'Decoding: dev tokens kept as the prefix of '
        'each sample; 0: half the window (seq_len // 2).')
    p.Define('decode_temperature', 1.0,
             'Decoding: softmax temperature of the sampling; 0: greedy.')
    p.Define('decode_top_k', 0,
             'Decoding: sample among the k most likely tokens; 0: all.')
    p.Define('decode_seed', 1234, 'Decoding: seed of the (stateless) sampling.')
    p.Define(
        'max_seq_len', 0, 'Rows of the position embedding: the longest '
        'sequence `generate` writes; 0: input.seq_len.')
    p.Define(
        'decode_cache', True, 'Decoding and `generate`: keep each layer\'s '
        'keys and values, one position per new token; False: re-run the '
        'window per token.')
    p.Define('decode_jit_compile', True,
             'decode_cache=True: compile the decoding loop with XLA.')
    p.eval.decoder_samples_per_summary = 16
    tp = p.train
    tp.learning_rate = 1e-3
    return p

  @classmethod
  def LayerStack(cls, task_params):
    """See PipelinedTask.LayerStack; the input shape is [batch_size, seq_len]."""
    p = task_params
    cls._CheckHasInput(p)
    if p.input.vocab_size != p.vocab_size:
      raise ValueError(
          f'The input\'s vocab_size={p.input.vocab_size} differs from the '
          f'task\'s vocab_size={p.vocab_size}; set both to the same value.')
    seq_len = p.input.seq_len
    stack = [
        layers.EmbeddingLayer.Params().Set(
            name='emb',
            vocab_size=p.vocab_size,
            embedding_dim=p.model_dim,
            max_seq_len=cls.MaxSeqLen(p),
            position_embedding=p.position_embedding,
            partitioner=p.partitioner,
            partition_strategy=p.partition_strategy),
    ]
    for i in range(p.num_layers):
      stack.append(layers.TransformerLayer.Params().Set(
          name='layer_%03d' % i,
          model_dim=p.model_dim,
          num_heads=p.num_heads,
          hidden_dim=p.hidden_dim,
          mask_self_atten=True))
    stack.append(layers.SoftmaxLayer.Params().Set(
        name='softmax',
        input_dim=p.model_dim,
        num_classes=p.vocab_size,
        apply_layer_norm=True,
        partitioner=p.partitioner,
        partition_strategy=p.partition_strategy))
    return stack, (tshape.Shape([p.input.batch_size, seq_len]),)

  @classmethod
  def MaxSeqLen(cls, task_params):
    """The position embedding's rows: task.max_seq_len, or input.seq_len."""
    p = task_params
    seq_len = p.input.seq_len
    if p.max_seq_len and p.max_seq_len < seq_len:
      raise ValueError(
          f'{p.name}: max_seq_len={p.max_seq_len} is below input.seq_len='
          f'{seq_len}; set it >= {seq_len}, or 0 for seq_len.')
    return p.max_seq_len or seq_len

  def _PipelineParams(self):
    # Token ids enter the pipeline as floats (exact below 2**24), so the
    # states between cells are float32 whatever the input dtype.
    return super()._PipelineParams().Set(state_dtype=tf.float32)

  def ComputePredictions(self, theta, input_batch):
    ids = tf.cast(input_batch.ids, tf.float32)
    logits = self.pipeline.FProp(theta.pipeline, ids)
    # With fprop_dtype=bfloat16 the loss and the sampling still see float32.
    return py_utils.NestedMap(logits=tf.cast(logits, tf.float32))

  def ComputeLoss(self, theta, predictions, input_batch):
    labels = input_batch.labels
    weights = input_batch.weights
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=predictions.logits)
    num_tokens = tf.reduce_sum(weights)
    denom = tf.maximum(num_tokens, 1.0)
    log_pplx = tf.reduce_sum(xent * weights) / denom
    correct = tf.cast(
        tf.equal(tf.argmax(predictions.logits, -1, output_type=tf.int32),
                 labels), tf.float32)
    accuracy = tf.reduce_sum(correct * weights) / denom
    per_example_tokens = tf.reduce_sum(weights, axis=1)
    per_example = tf.reduce_sum(xent * weights, axis=1) / tf.maximum(
        per_example_tokens, 1.0)
    metrics = {
        # Weighted by tokens, so averages over batches are per-token.
        'loss': (log_pplx, num_tokens),
        'log_pplx': (log_pplx, num_tokens),
        'token_accuracy': (accuracy, num_tokens),
        'num_tokens': (num_tokens, tf.constant(1.0)),
    }
    return metrics, {
        'loss': per_example,
        'example_ids': input_batch.example_ids
    }

  def Vocab(self):
    """The input generator's tokenizer.Vocab (ids to text: .Decode(ids))."""
    return self.input_generator.vocab

  # --- Inference subgraphs (Lingvo's Inference(); lingvo_ext.serving).

  def Inference(self):
    """{'default': (fetches, feeds), 'generate': (fetches, feeds)}.

    default: feeds ids, labels (int32 [batch, seq_len]) and weights (float32,
    0 on padding); fetches log_probs [batch, seq_len] (log p(labels[t] |
    ids[:t+1]), 0 where weights is 0), per_example_log_prob [batch] (their
    sum), per_example_log_pplx [batch] (minus their mean over real tokens,
    the evaler's per-example loss) and num_tokens [batch].

    generate: feeds prefix (int32 [batch, prefix_len], prefix_len >= 1),
    max_len (int32, prefix_len < max_len <= MaxSeqLen: the position
    embedding's rows), temperature (float32, 0: greedy), top_k (int32, 0:
    all tokens) and seed (int32); fetches ids (int32 [batch, max_len], the
    prefix and its continuation).
    """
    with tf.name_scope('inference'):
      return {
          'default': self._InferenceDefault(),
          'generate': self._InferenceGenerate(),
      }

  def _InferenceDefault(self):
    seq_len = self.params.input.seq_len
    ids = tf.placeholder(tf.int32, [None, seq_len], name='ids')
    labels = tf.placeholder(tf.int32, [None, seq_len], name='labels')
    weights = tf.placeholder(tf.float32, [None, seq_len], name='weights')
    logits = self.ComputePredictions(self.theta,
                                     py_utils.NestedMap(ids=ids)).logits
    log_probs = -tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits) * weights
    num_tokens = tf.reduce_sum(weights, axis=1)
    total = tf.reduce_sum(log_probs, axis=1)
    fetches = py_utils.NestedMap(
        log_probs=tf.identity(log_probs, name='log_probs'),
        per_example_log_prob=tf.identity(total, name='per_example_log_prob'),
        per_example_log_pplx=tf.identity(
            -total / tf.maximum(num_tokens, 1.0), name='per_example_log_pplx'),
        num_tokens=tf.identity(num_tokens, name='num_tokens'))
    feeds = py_utils.NestedMap(ids=ids, labels=labels, weights=weights)
    return fetches, feeds

  def _InferenceGenerate(self):
    p = self.params
    window = self.MaxSeqLen(p)
    prefix = tf.placeholder(tf.int32, [None, None], name='prefix')
    max_len = tf.placeholder(tf.int32, [], name='max_len')
    temperature = tf.placeholder(tf.float32, [], name='temperature')
    top_k = tf.placeholder(tf.int32, [], name='top_k')
    seed = tf.placeholder(tf.int32, [], name='seed')
    prefix_len = tf.shape(prefix)[1]
    checks = [
        tf.debugging.assert_positive(
            prefix_len, message='generate: prefix needs >= 1 token'),
        tf.debugging.assert_less(
            prefix_len, max_len, message='generate: max_len must exceed '
            'the prefix length'),
        tf.debugging.assert_less_equal(
            max_len, window, message=f'generate: max_len must be <= '
            f'{window}, the rows of the position embedding (task.max_seq_len, '
            'or input.seq_len when 0)'),
        tf.debugging.assert_non_negative(
            temperature, message='generate: temperature must be >= 0'),
        tf.debugging.assert_non_negative(
            top_k, message='generate: top_k must be >= 0'),
    ]
    with tf.control_dependencies(checks):
      prefix_checked = tf.identity(prefix)
    out = self.GenerateIds(self.theta, prefix_checked, max_len, temperature,
                           top_k, seed)
    fetches = py_utils.NestedMap(ids=tf.identity(out, name='ids'))
    feeds = py_utils.NestedMap(prefix=prefix, max_len=max_len,
                               temperature=temperature, top_k=top_k, seed=seed)
    return fetches, feeds

  def GenerateIds(self, theta, prefix, max_len, temperature, top_k, seed,
                  cache=None, jit_compile=None, window=None):
    """prefix int32 [B, P] continued to [B, max_len] (generate.py).

    Args:
      theta: The task's weights.
      prefix: int32 [B, P], 1 <= P < max_len.
      max_len: int32 scalar, <= window.
      temperature, top_k, seed: As NextToken's.
      cache: Keep keys and values (None: task.decode_cache).
      jit_compile: The cached loop in XLA (None: task.decode_jit_compile).
      window: The positions the loop can fill (None: the position
        embedding's rows, MaxSeqLen).
    """
    p = self.params
    cache = p.decode_cache if cache is None else cache
    jit = p.decode_jit_compile if jit_compile is None else jit_compile
    window = window or self.MaxSeqLen(p)
    if cache:
      return generate.CachedIds(self.pipeline, theta.pipeline, prefix,
                                max_len, window, temperature, top_k, seed,
                                jit)

    def Predict(ids):
      return self.ComputePredictions(theta,
                                     py_utils.NestedMap(ids=ids)).logits

    return generate.RerunIds(Predict, prefix, max_len, window, temperature,
                             top_k, seed)

  # --- Decoding (--job=decoder_dev): sampled continuations of dev prefixes.

  def _DecodePrefixLen(self):
    p = self.params
    seq_len = p.input.seq_len
    prefix = p.decode_prefix_len or seq_len // 2
    if not 0 < prefix < seq_len:
      raise ValueError(f'{p.name}: decode_prefix_len={p.decode_prefix_len} '
                       f'must be in [1, seq_len={seq_len}).')
    if p.decode_temperature < 0:
      raise ValueError(f'{p.name}: decode_temperature='
                       f'{p.decode_temperature} must be >= 0 (0: greedy).')
    if not isinstance(p.decode_top_k, int) or p.decode_top_k < 0:
      raise ValueError(f'{p.name}: decode_top_k={p.decode_top_k!r} must be '
                       'an int >= 0 (0: all tokens).')
    return prefix

  def Decode(self, input_batch):
    """Samples ids[:, prefix:] given ids[:, :prefix], one token a step."""
    p = self.params
    prefix = self._DecodePrefixLen()
    ids = input_batch.ids
    seq_len = p.input.seq_len
    # The re-run reference runs the training window, as the trainer does.
    sampled = self.GenerateIds(
        self.theta, ids[:, :prefix], seq_len, p.decode_temperature,
        p.decode_top_k, p.decode_seed,
        window=None if p.decode_cache else seq_len)
    return {
        'prefix': ids[:, :prefix],
        'sample': sampled[:, prefix:],
        'target': ids[:, prefix:],
        'example_ids': input_batch.example_ids,
    }

  def CreateDecoderMetrics(self):
    # Kept for DecodeFinalize, which Lingvo gives only the output path.
    self._dec_metrics = {'num_samples_in_batch': metrics_lib.AverageMetric()}
    self._samples = []
    return self._dec_metrics

  def PostProcessDecodeOut(self, dec_out, dec_metrics):
    vocab = self.Vocab()
    first = not self._samples
    real = dec_out['example_ids'] >= 0
    for i in range(len(real)):
      if not real[i]:
        continue
      self._samples.append(
          (int(dec_out['example_ids'][i]), vocab.Decode(dec_out['prefix'][i]),
           vocab.Decode(dec_out['sample'][i]),
           vocab.Decode(dec_out['target'][i])))
    dec_metrics['num_samples_in_batch'].Update(int(real.sum()))
    if first and self._samples:  # Lingvo writes summaries of the first batch.
      return [('samples', decoding.TextSummary('samples', '\n\n'.join(
          '**prefix** `%r`  \n**sample** `%r`  \n**dev text** `%r`' %
          (pre, smp, tgt) for _, pre, smp, tgt in self._samples)))]
    return []

  def DecodeFinalize(self, decode_finalize_args):
    """Writes samples-<step>.txt: each prefix, its sample and the dev text."""
    lines = []
    for ex_id, pre, smp, tgt in self._samples:
      lines += [f'example {ex_id}', f'  prefix:   {pre!r}',
                f'  sample:   {smp!r}', f'  dev text: {tgt!r}', '']
    decoding.WriteText(
        decoding.OutputPath(decode_finalize_args.decode_out_path, 'samples'),
        '\n'.join(lines))
