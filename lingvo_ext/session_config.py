"""Session configs every part builds from: Grappler passes off, local CPUs.

The lowest floor (no lingvo_ext import), so the pipeline layer, the
planner and the cluster's servers share one definition.
"""

from lingvo.core import py_utils
from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=g-direct-tensorflow-import


def WithoutRemapper(config):
  """`config` (a tf.ConfigProto) with Grappler's remapper off; returned.

  For bfloat16 where oneDNN is on (core/precision.py, `RemapperOff`).
  """
  config.graph_options.rewrite_options.remapping = (
      rewriter_config_pb2.RewriterConfig.OFF)
  return config


def WithoutIdlePasses(config):
  """`config` (a tf.ConfigProto) without two Grappler passes; returned.

  The TFG pipeline (toposort, shape inference, conditional code motion) and
  the memory optimizer (recomputation where a graph asks for it, swapping to
  a GPU's host) cost start-up; on the CPU graphs tested they change nothing,
  bit for bit (tests/runtime/test_session_config.py; docs/benchmarks.md).
  """
  rewrite = config.graph_options.rewrite_options
  rewrite.disable_tfg_optimizer = True
  rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
  return config


def LocalSessionConfig(num_devices: int):
  """A local trainer's session config on CPU (Lingvo's, without the idle
  passes), `num_devices` CPU devices: what the planner and the XLA timing
  build their probe sessions with."""
  config = WithoutIdlePasses(py_utils.SessionConfig())
  config.device_count['CPU'] = num_devices
  return config
