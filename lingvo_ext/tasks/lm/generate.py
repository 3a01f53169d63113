"""The LM's generation: a prefix continued token by token, two ways.

- Cached (`task.decode_cache=True`): the prefix runs once through the stack
  (`Prefill`), which keeps each Transformer layer's keys and values; then
  each new token is one position (`ExtendStep`, as Lingvo's layers decode),
  attending to the cache. With `task.decode_jit_compile` the whole loop is
  one XLA computation (`FUNCTION_NAME`), compiled once per batch size.
- Re-run: the whole window again for every new token (`RerunIds`); the
  reference the cached loop is tested against.

Both pick each token with `NextToken`, so the decoder job, `Inference()`'s
`generate` and the SavedModel signature give the same tokens.
"""

import lingvo.compat as tf
from lingvo.core import py_utils

from lingvo_ext import layers

# The compiled generation loop's function name (its call is no pipeline op:
# serving/saved_model.py's CountOps leaves it out).
FUNCTION_NAME = 'lingvo_ext_cached_generate'


def NextToken(logits, step, temperature, top_k, seed):
  """The next token of each row: greedy, or sampled (temperature, top-k).

  The decoder and the `generate` subgraph share it, so both pick the same
  tokens for the same prefix and seed.

  Args:
    logits: float32 [batch, vocab], the logits of the next position.
    step: int32 scalar, the position being filled (seeds the sampling).
    temperature: float32 scalar; 0: greedy (argmax), > 0: sampled from
      softmax(logits / temperature).
    top_k: int32 scalar; > 0: sample among the k most likely tokens only,
      0: among all.
    seed: int32 scalar, the seed of the (stateless) sampling.

  Returns:
    int32 [batch].
  """
  temperature = tf.convert_to_tensor(temperature, tf.float32)
  top_k = tf.convert_to_tensor(top_k, tf.int32)
  greedy = tf.argmax(logits, -1, output_type=tf.int32)
  vocab = tf.shape(logits)[-1]
  k = tf.where(top_k > 0, tf.minimum(top_k, vocab), vocab)
  # The k-th largest logit from a full sort: XLA needs top_k's k constant.
  kth = tf.gather(tf.sort(logits, axis=-1, direction='DESCENDING'), [k - 1],
                  axis=1)
  kept = tf.where(logits < kth, tf.fill(tf.shape(logits), -float('inf')),
                  logits)
  # Dividing by 1 where greedy keeps the unused sampling branch finite.
  scaled = kept / tf.where(temperature > 0, temperature, 1.0)
  sample = tf.random.stateless_categorical(
      scaled, 1, seed=tf.stack([tf.cast(seed, tf.int32), step]),
      dtype=tf.int32)[:, 0]
  return tf.where(temperature > 0, sample, greedy)


def StackLayers(pipeline):
  """[(cell name, layer name, layer)] of a PipeliningLayer's cells, in order.

  Raises:
    ValueError: the stack is not an embedding, causal Transformer layers and
      a softmax, the layers decoding runs one position at a time.
  """
  out = []
  for cell_name, cell in pipeline.Cells():
    for sub in cell.params.sub:
      out.append((cell_name, sub.name, cell.children[sub.name]))
  kinds = [type(l) for _, _, l in out]
  if (len(out) < 2 or kinds[0] is not layers.EmbeddingLayer or
      kinds[-1] is not layers.SoftmaxLayer or
      any(k is not layers.TransformerLayer for k in kinds[1:-1])):
    raise ValueError(
        f'{pipeline.params.name}: cached decoding needs an EmbeddingLayer, '
        'TransformerLayers and a SoftmaxLayer; got '
        f'{[k.__name__ for k in kinds]}. Set task.decode_cache=False.')
  return out


def _Run(stack, theta, ids, prefix_len, max_len, temperature, top_k, seed):
  """The cached loop: ids [B, S] with positions prefix_len..max_len-1 set."""
  (emb_cell, emb_name, emb), *middle, (sm_cell, sm_name, softmax) = stack
  window = py_utils.GetShape(ids)[1]

  def Logits(x):
    return tf.cast(softmax.FProp(theta[sm_cell][sm_name], x), tf.float32)

  def Put(ids, t, token):
    at = tf.equal(tf.range(window), t)[tf.newaxis, :]
    return tf.compat.v2.where(at, token[:, tf.newaxis], ids)

  # Prefill: the whole window (positions past the prefix are overwritten
  # before any later position attends to them); one shape per batch size.
  x = emb.FProp(theta[emb_cell][emb_name], ids)
  caches = []
  for cell, name, layer in middle:
    x, cache = layer.Prefill(theta[cell][name], x, window)
    caches.append(cache)
  token = NextToken(Logits(tf.gather(x, prefix_len - 1, axis=1)), prefix_len,
                    temperature, top_k, seed)
  ids = Put(ids, prefix_len, token)

  def Body(t, token, ids, caches):
    x = emb.ExtendStep(theta[emb_cell][emb_name], token, t - 1)
    new_caches = []
    for (cell, name, layer), cache in zip(middle, caches):
      x, cache = layer.ExtendStep(theta[cell][name], x, cache, t - 1)
      new_caches.append(cache)
    token = NextToken(Logits(x), t, temperature, top_k, seed)
    return t + 1, token, Put(ids, t, token), new_caches

  _, _, ids, _ = tf.while_loop(lambda t, *_: t < max_len, Body,
                               (prefix_len + 1, token, ids, caches))
  return ids


def CachedIds(pipeline, theta, prefix, max_len, window, temperature, top_k,
              seed, jit_compile):
  """A prefix's continuation from cached keys and values.

  Args:
    pipeline: The task's PipeliningLayer (see StackLayers).
    theta: Its weights.
    prefix: int32 [B, P], 1 <= P < max_len.
    max_len: int32 scalar <= window, the length of the output.
    window: int, the cache's length S (the position embedding's rows).
    temperature, top_k, seed: As NextToken's.
    jit_compile: Whether the loop is one XLA computation.

  Returns:
    int32 [B, max_len]: the prefix, then the tokens NextToken picked.
  """
  stack = StackLayers(pipeline)
  prefix_len = tf.shape(prefix)[1]
  ids = tf.ensure_shape(
      tf.pad(prefix, [[0, 0], [0, window - prefix_len]]), [None, window])
  args = (ids, prefix_len, tf.convert_to_tensor(max_len, tf.int32),
          tf.convert_to_tensor(temperature, tf.float32),
          tf.convert_to_tensor(top_k, tf.int32),
          tf.convert_to_tensor(seed, tf.int32))
  if not jit_compile:
    return _Run(stack, theta, *args)[:, :max_len]
  # The weights enter as tensors (read here), not as captured variables.
  flat = [tf.convert_to_tensor(w) for w in tf.nest.flatten(theta)]

  def Loop(flat, *args):
    return _Run(stack, tf.nest.pack_sequence_as(theta, flat), *args)

  Loop.__name__ = FUNCTION_NAME
  fn = tf.function(Loop, jit_compile=True, autograph=False)
  return fn(flat, *args)[:, :max_len]


def RerunIds(predict, prefix, max_len, window, temperature, top_k, seed):
  """A prefix's continuation, the whole window re-run for every token.

  Args:
    predict: ids [B, window] -> float32 logits [B, window, vocab].
    prefix, max_len, temperature, top_k, seed: As CachedIds'.
    window: int, the window `predict` takes.

  Returns:
    int32 [B, max_len].
  """
  prefix_len = tf.shape(prefix)[1]
  # Positions past t do not matter (causal attention): start them at 0.
  start = tf.ensure_shape(
      tf.pad(prefix, [[0, 0], [0, window - prefix_len]]), [None, window])
  pos = tf.broadcast_to(tf.range(window)[tf.newaxis, :], tf.shape(start))

  def Body(t, cur):
    token = NextToken(tf.gather(predict(cur), t - 1, axis=1), t, temperature,
                      top_k, seed)
    return t + 1, tf.where(
        tf.equal(pos, t), tf.broadcast_to(token[:, tf.newaxis],
                                          tf.shape(cur)), cur)

  _, out = tf.while_loop(lambda t, _: t < max_len, Body, (prefix_len, start))
  return out[:, :max_len]
