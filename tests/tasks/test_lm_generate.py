"""The LM's generation with a key-value cache against re-running the window.

TransformerLmTinyGPipe (2 cells) with random weights, built as the exporter
builds it (one device, do_eval): the cached loop (XLA-compiled and not) gives
the re-run's greedy ids for several prompts, batches and lengths, the
decoder job samples what `generate` samples, and `generate` refuses a
max_len past the position embedding, naming the bound.
"""

import sys

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext import layers
from lingvo_ext.serving import inference
from lingvo_ext.tasks.lm import generate

_LM = 'lm.TransformerLmTinyGPipe'


def _Task(overrides=''):
  """(graph, task) of _LM's inference params, random weights (seeded)."""
  tf.flags.FLAGS([sys.argv[0]])
  cfg = inference.InferenceParams(_LM, overrides)
  cfg.cluster.do_eval = True
  g = tf.Graph()
  with g.as_default(), cluster_factory.Cluster(cfg.cluster):
    tf.random.set_seed(5)
    task = cfg.Instantiate().GetTask()
  return g, task, cfg


def testCachedGreedyIdsAreTheRerunsAndSamplingAgrees():
  g, task, cfg = _Task('task.max_seq_len:64')
  with g.as_default(), cluster_factory.Cluster(cfg.cluster):
    prefix = tf.placeholder(tf.int32, [None, None])
    max_len = tf.placeholder(tf.int32, [])
    temperature = tf.placeholder(tf.float32, [])
    top_k = tf.placeholder(tf.int32, [])
    out = {
        name: task.GenerateIds(task.theta, prefix, max_len, temperature,
                               top_k, 7, **kw)
        for name, kw in (('xla', dict(cache=True, jit_compile=True)),
                         ('cached', dict(cache=True, jit_compile=False)),
                         ('rerun', dict(cache=False)))
    }
    init = tf.global_variables_initializer()
  rng = np.random.RandomState(0)
  with tf.Session(graph=g) as sess:
    sess.run(init)
    # One batch size: XLA compiles the loop once per batch size.
    batch = 3
    for prefix_len, length in ((1, 16), (5, 32), (13, 64), (31, 64), (4, 5),
                               (1, 2)):
      pre = rng.randint(2, 128, [batch, prefix_len]).astype(np.int32)
      greedy = sess.run(out, {prefix: pre, max_len: length, temperature: 0.0,
                              top_k: 0})
      assert greedy['rerun'].shape == (batch, length)
      np.testing.assert_array_equal(greedy['rerun'][:, :prefix_len], pre)
      for name in ('xla', 'cached'):
        np.testing.assert_array_equal(greedy[name], greedy['rerun'],
                                      err_msg=f'{name} {prefix_len} {length}')
      # Without XLA the cache samples the re-run's tokens too (XLA's
      # sampling kernel draws others: the decoder compiles the same loop).
      sampled = sess.run(out, {prefix: pre, max_len: length,
                               temperature: 0.8, top_k: 5})
      np.testing.assert_array_equal(sampled['cached'], sampled['rerun'])
      assert sampled['xla'].shape == (batch, length)


def testTheDecoderSamplesWhatGenerateSamples():
  g, task, cfg = _Task('task.decode_temperature:1.0;task.decode_prefix_len:6;'
                       'task.decode_seed:11')
  seq_len = cfg.input.seq_len
  ids = np.random.RandomState(1).randint(2, 128, [4, seq_len]).astype(
      np.int32)
  with g.as_default(), cluster_factory.Cluster(cfg.cluster):
    dec = task.Decode(py_utils.NestedMap(
        ids=tf.constant(ids), example_ids=tf.range(4)))
    gen = task.GenerateIds(task.theta, tf.constant(ids[:, :6]), seq_len, 1.0,
                           0, 11)
    init = tf.global_variables_initializer()
  with tf.Session(graph=g) as sess:
    sess.run(init)
    dec, gen = sess.run([dec, gen])
  np.testing.assert_array_equal(dec['sample'], gen[:, 6:])
  np.testing.assert_array_equal(dec['prefix'], ids[:, :6])
  np.testing.assert_array_equal(gen[:, :6], ids[:, :6])


@pytest.mark.parametrize('overrides, bound', [('', 32),
                                              ('task.max_seq_len:64', 64)])
def testGenerateRefusesMaxLenPastThePositionEmbedding(overrides, bound):
  # The checks run before the loop, compiled or not.
  jit = 'task.decode_jit_compile:False'
  g, task, cfg = _Task(f'{overrides};{jit}' if overrides else jit)
  with g.as_default(), cluster_factory.Cluster(cfg.cluster):
    fetches, feeds = task.Inference()['generate']
    init = tf.global_variables_initializer()
  with tf.Session(graph=g) as sess:
    sess.run(init)

    def Run(max_len, prefix_len=4):
      return sess.run(fetches.ids, {
          feeds.prefix: np.full([2, prefix_len], 3, np.int32),
          feeds.max_len: max_len, feeds.temperature: 0.0, feeds.top_k: 0,
          feeds.seed: 1})

    assert Run(bound).shape == (2, bound)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f'max_len must be <= {bound}, the rows of the '
                       r'position embedding \(task.max_seq_len'):
      Run(bound + 1)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match='max_len must exceed the prefix length'):
      Run(4)


def testMaxSeqLenBelowTheWindowIsAnError():
  with pytest.raises(ValueError, match='max_seq_len=16 is below '
                     'input.seq_len=32'):
    _Task('task.max_seq_len:16')


def testExtendStepEqualsFProp():
  """Position by position from a prefill, the layer gives FProp's outputs."""
  p = layers.TransformerLayer.Params().Set(
      name='t', model_dim=8, num_heads=2, hidden_dim=16, mask_self_atten=True)
  emb = layers.EmbeddingLayer.Params().Set(
      name='e', vocab_size=20, embedding_dim=8, max_seq_len=10)
  ids = np.random.RandomState(2).randint(0, 20, [3, 7]).astype(np.int32)
  with tf.Graph().as_default() as g:
    tf.random.set_seed(3)
    layer, embed = p.Instantiate(), emb.Instantiate()
    x = embed.FProp(embed.theta, tf.constant(ids))
    full = layer.FProp(layer.theta, x)
    out, cache = layer.Prefill(layer.theta, x[:, :3], 10)
    steps = [out]
    for t in range(3, 7):
      xt = embed.ExtendStep(embed.theta, tf.constant(ids[:, t]), t)
      y, cache = layer.ExtendStep(layer.theta, xt, cache, t)
      steps.append(y[:, tf.newaxis])
    steps = tf.concat(steps, 1)
    init = tf.global_variables_initializer()
  with tf.Session(graph=g) as sess:
    sess.run(init)
    full, steps = sess.run([full, steps])
  np.testing.assert_allclose(steps, full, rtol=1e-5, atol=1e-6)
  with tf.Graph().as_default():
    p.mask_self_atten = False
    with pytest.raises(ValueError, match='causal self-attention'):
      p.Instantiate().ExtendStep(None, None, None, 0)


def testStackLayersWalksTheCellsInOrder():
  g, task, _ = _Task()
  with g.as_default():
    stack = generate.StackLayers(task.pipeline)
  assert [type(l).__name__ for _, _, l in stack] == [
      'EmbeddingLayer', 'TransformerLayer', 'TransformerLayer',
      'SoftmaxLayer']
  assert [name for _, name, _ in stack] == ['emb', 'layer_000', 'layer_001',
                                            'softmax']
