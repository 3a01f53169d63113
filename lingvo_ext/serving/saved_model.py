"""Lingvo's inference graph of a task, and the TF2 SavedModel of a checkpoint.

`InferenceGraph` is Lingvo's `InferenceGraphExporter.Export` on the params
of `inference.SequentialParams`: the task's `Inference()` subgraphs, with
their feeds and fetches, which Lingvo's `predictor.Predictor` runs with a
checkpoint. `WriteSavedModel` freezes that graph with a checkpoint and
saves each subgraph as a serving signature of a TF2 SavedModel: typed, named
inputs and outputs, the batch dimension dynamic, no Lingvo op in it, so
`tf.saved_model.load` reads it in a process without Lingvo.
"""

import os
import re
import uuid

import lingvo.compat as tf
from lingvo.core import inference_graph_exporter

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.tasks.lm import generate

# Variable ops, whose names a checkpoint must hold.
_VARIABLE_OPS = ('VarHandleOp', 'VariableV2', 'Variable')

# Ops of the training pipeline that an exported graph must not hold: the
# engine's cell functions and Lingvo's recurrent loop, and the queues and
# sends between devices.
PIPELINE_OP_TYPES = ('PartitionedCall', 'StatefulPartitionedCall',
                     'Recv', 'Send', '_Recv', '_Send', 'StackV2',
                     'StackPushV2', 'StackPopV2')


def InferenceGraph(cfg, export_path=None, subgraphs=None):
  """Lingvo's InferenceGraph proto of the single-task model params `cfg`.

  Args:
    cfg: Model params, as from inference.InferenceParams (not modified).
    export_path: Write the graph as text here too (None: do not).
    subgraphs: Names of the subgraphs to keep (None: all).

  Returns:
    inference_graph_pb2.InferenceGraph, with the saver that restores a
    checkpoint into it.
  """
  # Lingvo's exporter turns absl's --enable_asserts off for the process
  # unless the user set it: off for the export's own build here, as it was
  # afterwards (a later build in the caller's process keeps its asserts).
  flag = tf.flags.FLAGS['enable_asserts']
  saved = flag.value, flag.using_default_value, flag.present
  try:
    return inference_graph_exporter.InferenceGraphExporter.Export(
        model_cfg=cfg.Copy(),
        export_path=export_path,
        subgraph_filter=list(subgraphs) if subgraphs else None,
        random_seed=1234)
  finally:
    flag.value, flag.using_default_value, flag.present = saved


def Freeze(proto, checkpoint):
  """A copy of InferenceGraph `proto` with `checkpoint`'s values as constants.

  Lingvo's exporter freezes only with TF2 behaviour off; this restores with
  the graph's own saver in a session and converts in any mode.
  """
  fetch_ops = sorted({
      _TensorName(t).split(':')[0]
      for sub in proto.subgraphs.values() for t in sub.fetches.values()
  })
  graph = tf.Graph()
  with graph.as_default():
    tf.import_graph_def(proto.graph_def, name='')
    with tf.Session(graph=graph) as sess:
      sess.run(proto.saver_def.restore_op_name,
               {proto.saver_def.filename_tensor_name: checkpoint})
      frozen_def = internal_tf.FreezeSessionGraph(sess, graph.as_graph_def(),
                                                  fetch_ops)
  # A name of its own per freeze: the process may hold other versions.
  _RenameFunctions(frozen_def, '_frozen_' + uuid.uuid4().hex[:12])
  _DropUnusedFunctions(frozen_def)
  _ConstantGathers(frozen_def)
  frozen = type(proto)()
  frozen.CopyFrom(proto)
  frozen.ClearField('saver_def')
  frozen.graph_def.CopyFrom(frozen_def)
  return frozen


def _FunctionsCalled(nodes):
  names = set()
  for node in nodes:
    for attr in node.attr.values():
      if attr.HasField('func'):
        names.add(attr.func.name)
      names.update(f.name for f in attr.list.func)
  return names


def _DropUnusedFunctions(graph_def):
  """Removes the functions no node calls (e.g. a dropped subgraph's loop).

  The converter leaves them unfrozen, reading variables that are gone.
  """
  by_name = {f.signature.name: f for f in graph_def.library.function}
  keep, todo = set(), list(_FunctionsCalled(graph_def.node))
  while todo:
    name = todo.pop()
    if name in keep or name not in by_name:
      continue
    keep.add(name)
    todo.extend(_FunctionsCalled(by_name[name].node_def))
  kept = [f for f in graph_def.library.function if f.signature.name in keep]
  del graph_def.library.function[:]
  graph_def.library.function.extend(kept)


def _ConstantGathers(graph_def):
  """ResourceGather ops left reading a frozen constant become GatherV2.

  TensorFlow's converter misses those inside While/If bodies (an embedding
  lookup in the generate loop): their input is a constant now.
  """

  def Fix(nodes, in_function):
    added = []
    for node in nodes:
      if node.op != 'ResourceGather':
        continue
      batch_dims = node.attr['batch_dims'].i if 'batch_dims' in node.attr else 0
      axis = tf.compat.v1.NodeDef(name=node.name + '/axis', op='Const')
      axis.attr['dtype'].type = tf.int32.as_datatype_enum
      axis.attr['value'].tensor.CopyFrom(
          tf.make_tensor_proto(batch_dims, tf.int32))
      added.append(axis)
      dtype = node.attr['dtype'].type
      for key in ('dtype', 'validate_indices'):
        if key in node.attr:
          del node.attr[key]
      node.op = 'GatherV2'
      node.attr['Tparams'].type = dtype
      node.attr['Taxis'].type = tf.int32.as_datatype_enum
      node.attr['batch_dims'].i = batch_dims
      node.input.insert(2, axis.name + (':output:0' if in_function else ''))
    nodes.extend(added)

  Fix(graph_def.node, False)
  for f in graph_def.library.function:
    Fix(f.node_def, True)


def _RenameFunctions(graph_def, suffix):
  """Appends `suffix` to every function of graph_def, and to its callers.

  Freezing rewrites the loop and branch functions under their old names;
  TensorFlow's eager context refuses or mixes up a second, different
  definition of a name it already holds (the unfrozen graph's, or an
  earlier export's).
  """
  names = {f.signature.name: f.signature.name + suffix
           for f in graph_def.library.function}

  def Fix(nodes):
    for node in nodes:
      for attr in node.attr.values():
        if attr.HasField('func') and attr.func.name in names:
          attr.func.name = names[attr.func.name]
        for f in attr.list.func:
          if f.name in names:
            f.name = names[f.name]

  Fix(graph_def.node)
  for f in graph_def.library.function:
    f.signature.name = names[f.signature.name]
    Fix(f.node_def)
  del graph_def.library.gradient[:]


def GraphVariables(graph_def):
  """The checkpoint names of the variables in `graph_def`, sorted.

  A partitioned variable's parts (`x/part_0`) are read from one saved `x`.
  """
  names = set()
  for node in graph_def.node:
    if node.op in _VARIABLE_OPS:
      names.add(re.sub(r'/part_\d+$', '', node.name))
  return sorted(names)


def MissingVariables(graph_def, checkpoint):
  """The variables of `graph_def` that `checkpoint` lacks, sorted."""
  saved = {name for name, _ in tf.train.list_variables(checkpoint)}
  return [v for v in GraphVariables(graph_def) if v not in saved]


def CountOps(graph_def, types):
  """How many nodes of `graph_def` (and of its functions) have op in types.

  A call of the LM's compiled generation loop (generate.FUNCTION_NAME) is
  not counted: it is no pipeline op.
  """

  def Counted(node):
    return node.op in types and not (
        'f' in node.attr and generate.FUNCTION_NAME in node.attr['f'].func.name)

  n = sum(Counted(node) for node in graph_def.node)
  for f in graph_def.library.function:
    n += sum(Counted(node) for node in f.node_def)
  return n


def _TensorName(name):
  return name if ':' in name else name + ':0'


def _IsPlaceholder(graph, tensor_name):
  try:
    op = graph.get_tensor_by_name(_TensorName(tensor_name)).op
  except KeyError:
    return False
  return op.type in ('Placeholder', 'PlaceholderWithDefault')


def _Signature(wrapped, subgraph):
  """A concrete tf.function serving one subgraph of the imported graph."""
  g = wrapped.graph
  # A serving input is a placeholder; Lingvo also lists tensors within the
  # graph as feeds (e.g. its LM's token ids, computed from the text feed).
  feeds = [(k, t) for k, t in sorted(subgraph.feeds.items())
           if _IsPlaceholder(g, t)]
  feed_tensors = [g.get_tensor_by_name(_TensorName(t)) for _, t in feeds]
  pruned = wrapped.prune(
      feeds=feed_tensors,
      fetches={k: g.get_tensor_by_name(_TensorName(t))
               for k, t in subgraph.fetches.items()})
  specs = [tf.TensorSpec(t.shape, t.dtype, name=k)
           for (k, _), t in zip(feeds, feed_tensors)]

  def Serve(*args):
    return pruned(*args)

  return tf.function(Serve, input_signature=specs).get_concrete_function()


def WriteSavedModel(frozen, export_dir, assets=None):
  """Writes the subgraphs of a frozen InferenceGraph as a TF2 SavedModel.

  Args:
    frozen: InferenceGraph proto exported with a freeze_checkpoint.
    export_dir: A directory that does not exist yet.
    assets: {file name: text} written under assets/ (e.g. vocab.json) and
      tracked by the SavedModel (its `assets` attribute).
  """
  with internal_tf.EagerMode():  # Also for callers in graph mode.
    _WriteSavedModel(frozen, export_dir, assets)


def _WriteSavedModel(frozen, export_dir, assets):
  module = tf.Module()

  def Import():
    tf.import_graph_def(frozen.graph_def, name='')

  # One import, pruned per subgraph (their functions are shared).
  wrapped = tf.compat.v1.wrap_function(Import, [])
  signatures = {}
  for name, subgraph in sorted(frozen.subgraphs.items()):
    signatures[name] = _Signature(wrapped, subgraph)
  # Lingvo names its main subgraph 'default'; TF Serving's default key is
  # serving_default.
  if 'default' in signatures:
    signatures['serving_default'] = signatures['default']
  module.signatures_kept = list(signatures.values())
  staging = export_dir + '.assets_tmp'
  tracked = {}
  if assets:
    tf.io.gfile.makedirs(staging)
    for file_name, text in assets.items():
      path = os.path.join(staging, file_name)
      with tf.io.gfile.GFile(path, 'w') as f:
        f.write(text)
      tracked[file_name] = tf.saved_model.Asset(path)
  module.assets = tracked
  try:
    tf.saved_model.save(module, export_dir, signatures=signatures)
  finally:
    if assets:
      tf.io.gfile.rmtree(staging)
