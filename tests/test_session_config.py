"""The trainer's Grappler passes off (server.WithoutIdlePasses) change nothing.

A pipelined Transformer trained a few steps under TensorFlow's default config
and under the one without the idle passes: the same partition graphs after
Grappler, and the same losses and variables bit for bit.
"""

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import pytest
from tensorflow.core.protobuf import rewriter_config_pb2

from lingvo_ext import trainer_flags
from lingvo_ext.core import layers_with_gpipe
from lingvo_ext.distributed import server
from tests import gpipe_testlib

_T, _B, _D, _VOCAB = 4, 8, 8, 5


def _Train(schedule, lean, steps=3):
  """(losses, variables after, the first step's partition graphs)."""
  g = tf.Graph()
  with g.as_default(), gpipe_testlib.Cluster(2):
    tf.random.set_seed(1)
    py_utils.GetOrCreateGlobalStepVar()
    p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
        name='transformer', model_dim=_D, num_encoder_layers=3,
        num_decoder_layers=0, splits=2, num_micro_batches=4,
        state_dtype=tf.float32, random_seed=0, schedule=schedule,
        loss_in_last_cell=True)
    p.encoder_tpl.source_dim = _D
    p.encoder_tpl.tr_atten_tpl.num_attention_heads = 2
    p.encoder_tpl.tr_fflayer_tpl.hidden_dim = 2 * _D
    p.emb_tpl.token_emb.Set(embedding_dim=_D, vocab_size=_VOCAB)
    p.emb_tpl.position_emb.embedding_dim = _D
    p.softmax_tpl.Set(input_dim=_D, num_classes=_VOCAB)
    net = p.Instantiate()
    rng = np.random.RandomState(0)
    ids = tf.constant(rng.randint(0, _VOCAB, [_T, _B]), tf.int32)
    labels = tf.constant(rng.randint(0, _VOCAB, [_T, _B]), tf.int32)
    weights = tf.constant(rng.uniform(0.5, 1.5, [_T, _B]), tf.float32)
    xent, _ = net.FPropDefaultTheta(ids, tf.zeros([_T, _B]), labels=labels,
                                    label_weights=weights)
    loss = tf.reduce_sum(xent)
    variables = net.vars.Flatten()
    grads = [tf.convert_to_tensor(x) for x in tf.gradients(
        loss, variables, colocate_gradients_with_ops=True)]
    with tf.control_dependencies(grads):
      train = tf.group([tf.assign_sub(v, 0.01 * dv)
                        for v, dv in zip(variables, grads)])
    init = tf.global_variables_initializer()
  config = tf.config_pb2.ConfigProto(
      device_count={'CPU': 2}, inter_op_parallelism_threads=2,
      intra_op_parallelism_threads=1)
  if lean:
    server.WithoutIdlePasses(config)
  metadata = tf.RunMetadata()
  losses = []
  with tf.Session(graph=g, config=config) as sess:
    sess.run(init)
    for step in range(steps):
      first = step == 0
      losses.append(sess.run(
          [loss, train],
          options=tf.RunOptions(output_partition_graphs=True) if first
          else None, run_metadata=metadata if first else None)[0])
    final = sess.run(variables)
  return losses, final, metadata.partition_graphs


def _Canonical(graphs):
  """Each partition's nodes (op, name, inputs, device) and functions."""
  out = []
  for gd in graphs:
    out.append((sorted((n.op, n.name, tuple(n.input), n.device)
                       for n in gd.node),
                sorted((f.signature.name, len(f.node_def))
                       for f in gd.library.function)))
  return sorted(out)


@pytest.mark.parametrize('schedule', ['unrolled', '1f1b'])
def test_without_the_idle_passes_a_pipeline_trains_bitwise_alike(schedule):
  losses, final, graphs = _Train(schedule, lean=False)
  lean_losses, lean_final, lean_graphs = _Train(schedule, lean=True)
  assert len(graphs) == 2
  assert _Canonical(lean_graphs) == _Canonical(graphs)
  assert lean_losses == losses
  for a, b in zip(lean_final, final):
    np.testing.assert_array_equal(a, b)


def test_the_trainers_sessions_skip_the_idle_passes():
  for distributed in (False, True):
    o = trainer_flags.Options(num_cpu_devices=2)
    if distributed:
      o = trainer_flags.Options(
          num_cpu_devices=2, cluster_spec='worker=127.0.0.1:1',
          job='worker', task=0)
    for client in (True, False):
      rewrite = server.SessionConfig(
          o, client=client).graph_options.rewrite_options
      assert rewrite.disable_tfg_optimizer
      assert rewrite.memory_optimization == (
          rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)
      assert not rewrite.disable_meta_optimizer
  # Lingvo's own config is left as it is.
  lingvo = py_utils.SessionConfig().graph_options.rewrite_options
  assert not lingvo.disable_tfg_optimizer
  assert lingvo.memory_optimization == (
      rewriter_config_pb2.RewriterConfig.DEFAULT_MEM_OPT)
