"""XLA-compiled cells of a convolutional task train as the uncompiled ones.

The trainer places a pipeline's cells on devices. Grappler's remapper, which
optimizes the session's function library, fused a cell body's placed
Conv2D + BiasAdd + Relu into _FusedConv2D, which XLA has no kernel for: the
first step failed (pipeline/cell_function.py builds XLA cells unplaced).
"""

from lingvo import model_registry
import lingvo.compat as tf
from lingvo.core import cluster_factory
import numpy as np

from lingvo_ext.tasks import experiment_params
import params  # pylint: disable=unused-import
from tests.support import gpipe_testlib as lib

MODEL = 'image.ConvClassifierTinyGPipe'
STEPS = 20


def _Losses(jit_compile):
  """STEPS training losses of MODEL on 2 devices, as the trainer builds it."""
  if not tf.flags.FLAGS.is_parsed():
    tf.flags.FLAGS.mark_as_parsed()
  mp = model_registry.GetParams(MODEL, 'Train').Copy()
  experiment_params.ApplyOverrides(mp, f'task.jit_compile:{jit_compile}')
  mp.task.train.save_interval_seconds = 1e9
  g = tf.Graph()
  cluster = cluster_factory.Cluster(lib.Cluster(2).params.Copy())
  # Placed as Lingvo's runners place a model.
  with g.as_default(), cluster, tf.device(cluster.GetPlacer()):
    tf.random.set_seed(1)
    model = mp.Instantiate()
    model.ConstructFPropBPropGraph()
    task = model.GetTask()
    train, loss = task.train_op, task.eval_metrics['loss'][0]
    init = tf.global_variables_initializer()
    functions = g.as_graph_def().library.function
  # Grappler with its remapper on, as TensorFlow's default session config.
  config = tf.config_pb2.ConfigProto(device_count={'CPU': 2})
  with tf.Session(graph=g, config=config) as sess:
    sess.run(init)
    return [sess.run([train, loss])[1] for _ in range(STEPS)], functions


def test_compiled_conv_cells_train_as_uncompiled_ones():
  plain, _ = _Losses(False)
  compiled, functions = _Losses(True)
  # The cells' bodies are XLA's to place (TensorFlow places the identities
  # of a function's outputs).
  compiled_bodies = [f for f in functions
                     if any(n.op == 'Conv2D' for n in f.node_def)]
  assert compiled_bodies
  for f in compiled_bodies:
    assert {n.device for n in f.node_def if n.op != 'Identity'} == {''}, (
        f.signature.name)
  np.testing.assert_allclose(compiled, plain, rtol=1e-3)
  assert np.mean(compiled[-5:]) < compiled[0]
