"""The trainer's Grappler passes off (session_config.WithoutIdlePasses)
change nothing.

A pipelined Transformer (tests/pipeline/test_loss_in_last_cell.py's, on 2 devices)
trained a few steps under TensorFlow's default config and under the one
without the idle passes: the same partition graphs after Grappler, and the
same losses and variables bit for bit.
"""

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import pytest
from tensorflow.core.protobuf import rewriter_config_pb2

from lingvo_ext import session_config
from lingvo_ext.distributed import server
from lingvo_ext.runtime import trainer_flags
from tests.pipeline import test_loss_in_last_cell


def _Train(schedule, lean, steps=3):
  """(losses, variables after, the first step's partition graphs)."""
  g, (init, loss, _, train, variables) = test_loss_in_last_cell.Build(
      schedule, True, devices=2, layers=3, splits=2, micro=4)
  config = tf.config_pb2.ConfigProto(
      device_count={'CPU': 2}, inter_op_parallelism_threads=2,
      intra_op_parallelism_threads=1)
  if lean:
    session_config.WithoutIdlePasses(config)
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
  local = trainer_flags.Options(num_cpu_devices=2)
  distributed = trainer_flags.Options(
      num_cpu_devices=2, cluster_spec='worker=127.0.0.1:1', job='worker',
      task=0)
  for o in (local, distributed):
    for client in (True, False):
      rewrite = server.SessionConfig(
          o, client=client).graph_options.rewrite_options
      assert rewrite.disable_tfg_optimizer
      assert rewrite.memory_optimization == (
          rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)
      assert not rewrite.disable_meta_optimizer
  # A run with GPUs keeps TensorFlow's passes (the memory optimizer swaps
  # to a GPU's host); so does Lingvo's own config.
  gpus = server.SessionConfig(trainer_flags.Options(
      worker_gpus=1)).graph_options.rewrite_options
  assert not gpus.disable_tfg_optimizer
  assert gpus.memory_optimization == (
      rewriter_config_pb2.RewriterConfig.DEFAULT_MEM_OPT)
  lingvo = py_utils.SessionConfig().graph_options.rewrite_options
  assert not lingvo.disable_tfg_optimizer
  assert lingvo.memory_optimization == (
      rewriter_config_pb2.RewriterConfig.DEFAULT_MEM_OPT)
