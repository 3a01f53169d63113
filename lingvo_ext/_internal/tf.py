"""TensorFlow internals lingvo_ext needs, each behind one small function.

Each has a test in tests/_internal/. Where TensorFlow has a public
equivalent, lingvo_ext uses it instead (tf.raw_ops.CollectiveReduceV2,
tf.compat.v1.ConditionalAccumulator, tf.register_tensor_conversion_function,
tf.compat.v1.train.update_checkpoint_state, graph.colocate_with,
tf.distribute.cluster_resolver.*).
"""

import contextlib
import threading
import weakref

import tensorflow as tf

# pylint: disable=g-direct-tensorflow-import
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context as tf_context
from tensorflow.python.eager.polymorphic_function import concrete_function
from tensorflow.python.framework import func_graph as tf_func_graph
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import math_grad
from tensorflow.python.training import checkpoint_state_pb2
from tensorflow.python.training.saving import saveable_object
from tensorflow.python.util import _pywrap_util_port

from lingvo_ext import xla_cache

# pylint: enable=g-direct-tensorflow-import

# A checkpoint that restores through a custom object (stacking.py's views of
# stacked variables) is a SaveableObject of SaveSpecs; no public API offers
# one in TF1 graph mode.
SaveableObject = saveable_object.SaveableObject
SaveSpec = saveable_object.SaveSpec

# The `checkpoint` state file's proto: parsed directly so that a damaged file
# is reported (tf.train.get_checkpoint_state logs and returns None).
CheckpointState = checkpoint_state_pb2.CheckpointState


@contextlib.contextmanager
def V1ControlFlow():
  """tf.cond inside builds Switch/Merge (control flow v1).

  A (Sparse)ConditionalAccumulator's handle is a ref, which a functional
  (v2) cond cannot capture. A process-wide switch: set only while building.
  """
  saved = control_flow_util.ENABLE_CONTROL_FLOW_V2
  control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
  try:
    yield
  finally:
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = saved


# A tf.function named with this prefix (see StableFunctionName) has names that
# do not depend on what the process traced before.
_STABLE = 'lx_stable_'
_stable_counts = weakref.WeakKeyDictionary()  # Root graph -> {name: count}.
_stable_lock = threading.Lock()


def StableFunctionName(name: str) -> str:
  """A Python function name whose tf.function, and the forward and backward
  functions TensorFlow derives from it, are numbered by their order in their
  graph rather than by the process's id counter.

  XLA's persistent compile cache keys a compiled function by its name and its
  HLO (which holds the name). With TensorFlow's numbering, whatever a process
  traced before (jit_choice.py's timing graphs) renames every function after
  it, and the next process compiles them again. Graph mode only; a name
  another graph of the process already holds with another body takes
  TensorFlow's numbering. Only where the program asked for it
  (xla_cache.UseStableNames): otherwise `name` as it is.
  """
  if not xla_cache.StableNames():
    return name
  _InstallStableNames()
  return _STABLE + name


def _Root(graph):
  while isinstance(graph, tf_func_graph.FuncGraph) and graph.outer_graph:
    graph = graph.outer_graph
  return graph


def _StableNamer(prefix, uid_namer):

  def Name(n):
    if _STABLE not in n or tf_context.executing_eagerly():
      return uid_namer(n)
    root = _Root(tf_ops.get_default_graph())
    if isinstance(root, tf_func_graph.FuncGraph):
      return uid_namer(n)
    with _stable_lock:
      counts = _stable_counts.setdefault(root, {})
      k = counts.get(prefix + n, 0)
      counts[prefix + n] = k + 1
    return '%s%s_s%d' % (prefix, n, k)

  Name.lingvo_ext_stable = True
  return Name


def _OrUniqueName(from_func_graph):
  """from_func_graph that renames a stable name another graph of the process
  holds with another body (the process's function registry is shared)."""

  def FromFuncGraph(name, graph, *args, **kwargs):
    try:
      return from_func_graph(name, graph, *args, **kwargs)
    except tf.errors.InvalidArgumentError as e:
      text = name.decode() if isinstance(name, bytes) else name
      if _STABLE not in text or 'duplicate function' not in str(e):
        raise
      return from_func_graph('%s_u%d' % (text, tf_ops.uid()), graph, *args,
                             **kwargs)

  FromFuncGraph.lingvo_ext_stable = True
  return FromFuncGraph


def _InstallStableNames():
  """Wraps TensorFlow's namers of a tf.function's inference, forward and
  backward functions (once per process; other names are left as they are)."""
  cf = concrete_function
  with _stable_lock:
    # pylint: disable=protected-access
    if getattr(cf._inference_name, 'lingvo_ext_stable', False):
      return
    cf._inference_name = _StableNamer(cf._INFERENCE_PREFIX, cf._inference_name)
    cf._forward_name = _StableNamer(cf._FORWARD_PREFIX, cf._forward_name)
    cf._backward_name = _StableNamer(cf._BACKWARD_PREFIX, cf._backward_name)
    # pylint: enable=protected-access
    atomic = cf.atomic_function
    atomic.from_func_graph = _OrUniqueName(atomic.from_func_graph)


def MatMulGrad(op, grad):
  """TensorFlow's registered gradient of MatMul (for a gradient override)."""
  return math_grad._MatMulGrad(op, grad)  # pylint: disable=protected-access


def BatchMatMulV2Grad(op, grad):
  """TensorFlow's registered gradient of BatchMatMulV2 (for an override)."""
  return math_grad._BatchMatMulV2(op, grad)  # pylint: disable=protected-access


def IsMklEnabled() -> bool:
  """Whether TensorFlow's CPU kernels are oneDNN's (MKL) rather than Eigen's."""
  return bool(_pywrap_util_port.IsMklEnabled())


def SaveSliceInfo(variable):
  """A partitioned variable's slice info (a shard of it), else None."""
  return getattr(variable, '_save_slice_info', None)


def OpId(op) -> int:
  """The op's creation index in its graph (increasing)."""
  return op._id  # pylint: disable=protected-access


def UpdateInput(op, index: int, tensor) -> None:
  """Makes input `index` of an op that is already built read `tensor`.

  A cell function (cell_function.py) routes a weight MatMul's output through
  an added op after the cell's FProp has built it; no public API rewires an
  op's input.
  """
  op._update_input(index, tensor)  # pylint: disable=protected-access


def FunctionGraph(op):
  """The FuncGraph of the function a call op (PartitionedCall) runs, or None.

  The gradient sync looks inside a cell function's call for how it uses a
  weight; a v1 graph keeps its functions by name, with no public lookup.
  """
  try:
    name = op.get_attr('f').name
  except ValueError:  # Not a function call.
    return None
  fn = op.graph._get_function(name)  # pylint: disable=protected-access
  return getattr(fn, 'graph', None)


def OpGradients(op, out_grads):
  """The gradients of one op's inputs from those of its outputs.

  What tf.gradients computes for a single op (its gradient function, given
  zeros for float outputs without a gradient), without tf.gradients' first
  step, which marks every op reachable forwards from the inputs: in a
  pipeline that is the rest of the forward pass and all the backward pass
  built so far, so differentiating one cell call per (cell, micro-batch)
  that way made building the backward pass quadratic in the pipeline's size.
  No public API differentiates one op.

  Args:
    op: The op (one with a gradient function).
    out_grads: One per output of `op`: its gradient, or None.

  Returns:
    One per input of `op`: its gradient, or None.
  """
  grad_fn = tf_ops.get_gradient_function(op)
  # One ZerosLike op each, as tf.gradients makes (tf.zeros_like would make a
  # Fill and two constants of a known shape).
  out_grads = [
      tf.raw_ops.ZerosLike(x=y) if g is None and y.dtype.is_floating else g
      for y, g in zip(op.outputs, out_grads)
  ]
  # Named as tf.gradients names them.
  with tf.name_scope(op.name + '_grad'):
    in_grads = grad_fn(op, *out_grads)
  in_grads = (list(in_grads) if isinstance(in_grads, (list, tuple))
              else [in_grads])
  for x, g in zip(op.inputs, in_grads):
    if isinstance(g, tf.Tensor) and x.dtype != tf.resource:
      g.set_shape(x.shape)
  return in_grads


@contextlib.contextmanager
def CallsOptimizedOnce():
  """Function calls built inside are not optimized again per call site.

  A session's Grappler optimizes the graph's function library once. A call
  op also carries a config (the eager context's, by default with Grappler
  on) under which the runtime optimizes the function's body again each time
  it instantiates the call: once per call site, so a pipeline's K x M calls
  of its cells' functions and their gradients, which lengthens the first
  step. Inside, calls carry the context's config with the meta optimizer
  off. Thread-local, as the options are.
  """
  ctx = tf_context.context()
  saved = ctx.function_call_options
  config = config_pb2.ConfigProto.FromString(saved.config_proto_serialized)
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  ctx.function_call_options = tf_context.FunctionCallOptions(
      executor_type=saved.executor_type, config_proto=config)
  try:
    yield
  finally:
    ctx.function_call_options = saved


def EagerMode():
  """A context that executes eagerly, even where the process disabled it.

  TF2's SavedModel writer needs eager execution; a caller in graph mode
  (Lingvo's `SetEagerMode(False)`, `disable_eager_execution`) otherwise gets
  "Unable to save checkpoint ... in graph mode without a default session".
  """
  return tf_context.eager_mode()


def AddControlInput(op, dependency) -> None:
  """Adds a control input to an op that is already built."""
  op._add_control_input(dependency)  # pylint: disable=protected-access


@contextlib.contextmanager
def LocalServerConfig(config):
  """tf.distribute.Server.create_local_server() inside uses `config`.

  Lingvo's RunnerManager.MaybeConfigRunLocally makes the in-process server
  with create_local_server() and no config; its devices (e.g. N logical
  CPUs) come from the server's config, not the sessions'. Set only for that
  call.
  """
  server_cls = tf.distribute.Server
  original = server_cls.__dict__['create_local_server']

  def CreateLocalServer(config=config, start=True):
    return original.__func__(config=config, start=start)

  server_cls.create_local_server = staticmethod(CreateLocalServer)
  try:
    yield
  finally:
    server_cls.create_local_server = original


def SlurmClusterResolverModule():
  """TensorFlow's slurm_cluster_resolver module.

  Its SlurmClusterResolver is public (tf.distribute.cluster_resolver), its
  expand_hostlist / expand_tasks_per_node (Slurm's compact host and task
  lists) are not.
  """
  from tensorflow.python.distribute.cluster_resolver import (
    slurm_cluster_resolver,  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  )
  return slurm_cluster_resolver


def MakeCallable(sess, fetch_names, target_names):
  """A callable running `sess` on these tensor and op names, built now.

  Session::MakeCallable prunes, places and optimizes its graph when it is
  made (Session.run does that at the first run of each signature, and
  Session.make_callable defers to it); TensorFlow releases the GIL meanwhile.
  Called with no arguments, it returns the fetches' values in order.
  """
  options = config_pb2.CallableOptions()
  options.fetch.extend(fetch_names)
  options.target.extend(target_names)
  return sess._make_callable_from_options(options)  # pylint: disable=protected-access


def FreezeSessionGraph(sess, graph_def, output_node_names):
  """graph_def with its variables as constants read from `sess`.

  TensorFlow's v2 converter: unlike the public
  tf.compat.v1.graph_util.convert_variables_to_constants it also rewrites the
  variable reads inside functional While/If bodies.
  """
  from tensorflow.python.framework import convert_to_constants  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  return convert_to_constants.convert_variables_to_constants_from_session_graph(
      sess, graph_def, list(output_node_names))
