"""Stacked variables: same-shape weights of repeated layers in one variable.

Mesh TensorFlow's `rewrite_stack_variables` in Lingvo's variable world. While
a `VariableStacker` records (`Record`), Lingvo layers' `CreateVariable` calls
create no variable; `Stack` then groups what was recorded by (shape, dtype,
trainable, collections, synchronization, aggregation) -- collections decide
the optimizer's update in Lingvo (e.g. weight decay) -- and creates one
variable of shape [n, ...] per group in the current device scope. Each layer's
theta entry becomes its slice (one read and one Unpack per group), so
gradients arrive stacked and the optimizer applies one update op per group,
with stacked slot variables (Adam's m and v, momentum's accumulator).

Checkpoints keep the per-layer names. The stacked variable is not in
GLOBAL_VARIABLES; a `StackedVariableView` per layer is, under the variable's
per-layer ("master") name. It reads and restores its slice and is a
`SaveableObject`, so both `tf.train.Saver` and Lingvo's own saver write and
read `lm/cell_001/qkv/w/var` as if the model were unstacked, and the same
checkpoint restores into the stacked and the unstacked model. After the
optimizer has made its slots, `StackSlotVariables()` does the same for them
(`.../w/var/Adam`); like Mesh-TF's rewrite, it refuses to run twice on a
graph.
"""

import collections
import contextlib
from typing import List
from typing import Optional

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
import numpy as np

from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.pipeline import graph_state

# Collection of the stacked variables of a graph (they are not in
# GLOBAL_VARIABLES; their views are).
STACKED_VARIABLES = 'lingvo_ext_stacked_variables'
# Default cap on a stacked variable, as Mesh-TF's max_combined_variable_size.
DEFAULT_MAX_COMBINED_VARIABLE_SIZE = 2**29

_RECORDING = py_utils.ThreadLocalStack()
# Per graph: {'views': {stacked op name: (variable, [master names])},
# 'init' and 'unstacked': {id(variable): ops}, 'slots_done': bool}.
# Kept on the graph (graph_state): freed with it.


def _State(graph):
  return graph_state.Get(graph, 'stacking', lambda: {
      'views': {}, 'init': {}, 'unstacked': {}, 'slots_done': False})


class _PendingVariable:
  """What a recorded CreateVariable returns until `Stack` replaces it."""

  def __init__(self, next_creator, kwargs):
    self.next_creator = next_creator
    self.kwargs = kwargs
    self.shape = tf.TensorShape(kwargs['shape'])
    self.dtype = tf.as_dtype(kwargs['dtype'])
    self.device = ''
    self.name = kwargs['var_name'] + '/var:0'


def _PendingToTensor(value, dtype=None, name=None, as_ref=False):
  # Only reached where a layer uses a variable in __init__ (e.g. Lingvo's GPU
  # path caches tf.identity(var)); a dead zero tensor, replaced by Stack.
  del dtype, as_ref
  return tf.zeros(value.shape, value.dtype, name=name)


tf.register_tensor_conversion_function(_PendingVariable, _PendingToTensor)


class _ViewOp:
  """Stands for a view's op where only a name is read (uninit. reports)."""

  def __init__(self, name):
    self.name = name


class StackedVariableView(internal_tf.SaveableObject):
  """Slice `index` of a stacked variable under its per-layer name.

  It stands in GLOBAL_VARIABLES for the variable the layer would have had:
  initializer, is_initialized, read_value and assign act on the slice, and as
  a SaveableObject it saves and restores the slice under that name.
  """

  def __init__(self, stacked, index, name):
    self._stacked = stacked
    self._index = index
    spec = internal_tf.SaveSpec(
        self.read_value, '', name, dtype=stacked.dtype.base_dtype,
        device=stacked.device)
    super().__init__(_ViewOp(name), [spec], name + ':0')

  @property
  def stacked(self):
    return self._stacked

  @property
  def index(self):
    return self._index

  @property
  def dtype(self):
    return self._stacked.dtype

  @property
  def shape(self):
    return self._stacked.shape[1:]

  def get_shape(self):
    return self.shape

  @property
  def graph(self):
    return self._stacked.graph

  @property
  def device(self):
    return self._stacked.device

  @property
  def initializer(self):
    return self._stacked.initializer

  @property
  def trainable(self):
    return self._stacked.trainable

  def is_initialized(self, name=None):
    return self._stacked.is_initialized(name=name)

  def read_value(self):
    return _Unstacked(self._stacked)[self._index]

  def value(self):
    return self.read_value()

  def assign(self, value, use_locking=None, name=None, read_value=False):
    """Assigns the slice, initializing the stacked variable first if needed."""
    del use_locking, read_value
    with tf.device(self._stacked.device):
      with tf.control_dependencies([_EnsureInitialized(self._stacked)]):
        return self._stacked[self._index].assign(value, name=name).op

  def restore(self, restored_tensors, restored_shapes):
    del restored_shapes
    return self.assign(restored_tensors[0])


def _ViewToTensor(value, dtype=None, name=None, as_ref=False):
  del dtype, name, as_ref
  return value.read_value()


tf.register_tensor_conversion_function(StackedVariableView, _ViewToTensor)


def _Unstacked(var):
  """The slices of `var`: one read and one Unpack per graph, shared by views.

  A saver reads every view; slicing a fresh read per view would cost n
  reads of the whole variable.
  """
  cache = _State(var.graph)['unstacked']
  if id(var) not in cache:
    with tf.control_dependencies(None), tf.name_scope(None):
      with tf.device(var.device), tf.name_scope(var.op.name + '/views'):
        cache[id(var)] = tf.unstack(var.read_value(), num=var.shape[0])
  return cache[id(var)]


def _EnsureInitialized(var):
  """One op per variable: zeros it if uninitialized, so slices can be set.

  Restoring a checkpoint assigns slice by slice, and a slice assign needs an
  initialized variable. All slice assigns of a restore depend on this one op,
  so it runs once, before them; an initialized variable is left alone.
  """
  cache = _State(var.graph)['init']
  if id(var) not in cache:
    with tf.control_dependencies(None), tf.name_scope(None):
      with tf.device(var.device), tf.name_scope(var.op.name + '/ensure_init'):
        cache[id(var)] = tf.cond(
            var.is_initialized(), lambda: tf.constant(False),
            lambda: _AssignZeros(var))
  return cache[id(var)]


def _AssignZeros(var):
  with tf.control_dependencies(
      [var.assign(tf.zeros(var.shape, var.dtype.base_dtype)).op]):
    return tf.constant(True)


def _Views(graph) -> dict:
  """{stacked variable op name: (variable, [master names])} of a graph."""
  return _State(graph)['views']


def StackedVariables(graph=None) -> List[tf.Variable]:
  """The stacked variables of `graph` (default: the default graph)."""
  graph = graph or tf.get_default_graph()
  return graph.get_collection(STACKED_VARIABLES)


def MasterNames(var) -> List[str]:
  """The per-layer checkpoint names of a stacked variable's slices."""
  return list(_Views(var.graph)[var.op.name][1])


def _AddViews(var, names):
  graph = var.graph
  views = [StackedVariableView(var, i, n) for i, n in enumerate(names)]
  for v in views:
    graph.add_to_collection(tf.GraphKeys.GLOBAL_VARIABLES, v)
  return views


class VariableStacker:
  """Records Lingvo layers' variables, then stacks them group by group.

  Usage (what SeqLayer does for each cell)::

    stacker = VariableStacker(max_combined_variable_size)
    with stacker.Record():
      self.CreateChild(name, cell_params)   # no variables are created
    stacker.Stack(self.children[name], 'cell_name')
  """

  def __init__(self, max_combined_variable_size=(
      DEFAULT_MAX_COMBINED_VARIABLE_SIZE)):
    if (not isinstance(max_combined_variable_size, (int, np.integer)) or
        max_combined_variable_size < 1):
      raise ValueError(
          f'max_combined_variable_size={max_combined_variable_size!r} must be '
          'a positive number of bytes, e.g. 2**29 (the default).')
    self._max_bytes = int(max_combined_variable_size)
    self._pending = []
    self._stacked = []  # (name, variable) created by Stack.

  @property
  def stacked(self):
    """(name, variable) of every stacked variable made so far, in order."""
    return list(self._stacked)

  def _Creator(self, next_creator, **kwargs):
    pending = _PendingVariable(next_creator, kwargs)
    self._pending.append(pending)
    return pending

  @contextlib.contextmanager
  def Record(self):
    """Inside, Lingvo CreateVariable calls are recorded, not executed."""
    if _RECORDING.stack:
      raise ValueError(
          'Variables are already being stacked by an outer layer with '
          'stack_variables=True; stacking them again is not supported. Set '
          'stack_variables=True on one layer only (the outermost).')
    _RECORDING.stack.append(self)
    try:
      with py_utils.VariableCreatorScope(self._Creator):
        yield
    finally:
      _RECORDING.stack.pop()

  def Stack(self, root: base_layer.BaseLayer, prefix: str):
    """Creates the stacked variables of what was recorded under `root`.

    Call it in the variable scope and device scope the variables belong in.

    Args:
      root: The layer constructed while recording.
      prefix: Names the stacked variables ('<prefix>_stacked_<k>').

    Returns:
      A dict {key: stacked variable}, keys '<prefix>_stacked_<k>'.

    Raises:
      ValueError: a recorded variable is not in any layer's vars.
    """
    pending, self._pending = self._pending, []
    if not pending:
      return {}
    owners = {}  # id(pending) -> (layer, key)
    for layer in _Layers(root):
      for key, v in internal_lingvo.PrivateVars(layer).items():
        if isinstance(v, _PendingVariable):
          owners[id(v)] = (layer, key)
    missing = [p.name for p in pending if id(p) not in owners]
    if missing:
      raise ValueError(
          f'stack_variables: {missing} were created with CreateVariable but '
          'are not in any layer\'s vars (made with py_utils.CreateVariable '
          'directly?); they cannot be stacked. Create them with the layer\'s '
          'CreateVariable, or set stack_variables=False.')
    groups = collections.OrderedDict()
    for p in pending:
      groups.setdefault(_GroupKey(p.kwargs), []).append(p)
    result = collections.OrderedDict()
    for members in groups.values():
      for chunk in self._Chunks(members):
        if len(chunk) == 1:
          # Nothing to stack: the variable Lingvo would have made (Lingvo's
          # creators name it absolutely, so creating it here is the same).
          p = chunk[0]
          layer, name = owners[id(p)]
          var = p.next_creator(**p.kwargs)
          internal_lingvo.PrivateVars(layer)[name] = var
          internal_lingvo.PrivateTheta(layer)[name] = var
          continue
        key = '%s_stacked_%03d' % (prefix, len(result))
        var = self._CreateStacked(key, chunk)
        result[key] = var
        self._stacked.append((key, var))
        with tf.device(var.device), tf.name_scope(key + '_unstack'):
          slices = tf.unstack(var.read_value(), num=len(chunk))
        for p, s in zip(chunk, slices):
          layer, name = owners[id(p)]
          del internal_lingvo.PrivateVars(layer)[name]
          internal_lingvo.PrivateTheta(layer)[name] = s
    return result

  def _Chunks(self, members):
    """Splits a group at max_combined_variable_size bytes."""
    size = members[0].shape.num_elements() * members[0].dtype.size
    per_chunk = max(1, self._max_bytes // max(size, 1))
    return [members[i:i + per_chunk] for i in range(0, len(members), per_chunk)]

  def _CreateStacked(self, name, chunk):
    kwargs = chunk[0].kwargs
    shape = chunk[0].shape.as_list()
    dtype = chunk[0].dtype

    def _Init(*unused_args, **unused_kwargs):
      values = []
      for p in chunk:
        init = p.kwargs['initializer']
        if callable(init):
          values.append(init(shape, dtype=dtype))
        else:
          values.append(tf.convert_to_tensor(init, dtype=dtype))
      return tf.stack(values)

    trainable = kwargs['trainable']
    colls = [STACKED_VARIABLES]
    colls += list(kwargs['var_params'].collections or [])
    if kwargs.get('collections'):
      colls += [
          c for c in kwargs['collections']
          if c != tf.GraphKeys.GLOBAL_VARIABLES
      ]
    if trainable:
      colls.append(tf.GraphKeys.TRAINABLE_VARIABLES)
    with tf.variable_scope(name):
      var = tf.get_variable(
          'var',
          shape=[len(chunk)] + shape,
          dtype=dtype,
          initializer=_Init,
          trainable=trainable,
          collections=list(dict.fromkeys(colls)),
          use_resource=True,
          synchronization=kwargs.get('synchronization',
                                     tf.VariableSynchronization.AUTO),
          aggregation=kwargs.get('aggregation', tf.VariableAggregation.NONE))
    names = [p.kwargs['var_name'] + '/var' for p in chunk]
    _Views(var.graph)[var.op.name] = (var, names)
    _AddViews(var, names)
    return var


def _GroupKey(kwargs):
  """Variables stack iff shape, dtype, trainability and update agree."""
  p = kwargs['var_params']
  return (tuple(tf.TensorShape(kwargs['shape']).as_list()),
          tf.as_dtype(kwargs['dtype']).name, bool(kwargs['trainable']),
          tuple(sorted(p.collections or [])),
          tuple(sorted(kwargs.get('collections') or [])),
          str(kwargs.get('synchronization')), str(kwargs.get('aggregation')))


def _Layers(root):
  """root and all its descendant layers."""
  out, stack = [], [root]
  while stack:
    layer = stack.pop()
    out.append(layer)
    stack.extend(py_utils.Flatten(layer.children))
  return out


def StackSlotVariables(graph: Optional[tf.Graph] = None) -> int:
  """Checkpoints the optimizer slots of stacked variables per layer.

  Call it once, after the optimizer has created its slots (after
  `apply_gradients`, Lingvo's BProp) and before building a Saver. Each slot
  variable of a stacked variable (shape [n, ...], named '<stacked>/<slot>',
  e.g. Adam's m and v) leaves GLOBAL_VARIABLES and n views take its place,
  named '<per-layer name>/<slot>' as the unstacked model's slots are.

  Args:
    graph: The graph; the default graph if None.

  Returns:
    The number of slot variables rewritten.

  Raises:
    ValueError: if called a second time on the same graph.
  """
  graph = graph or tf.get_default_graph()
  if _State(graph)['slots_done']:
    raise ValueError(
        'StackSlotVariables was already called on this graph; it rewrites '
        'the slot variables once (call it once, after the optimizer has '
        'built its update).')
  _State(graph)['slots_done'] = True
  stacked = _Views(graph)
  global_vars = graph.get_collection_ref(tf.GraphKeys.GLOBAL_VARIABLES)
  keep, count = [], 0
  new_views = []
  for v in global_vars:
    if isinstance(v, StackedVariableView) or not hasattr(v, 'op'):
      keep.append(v)
      continue
    # Slots are named '<primary op name>/<slot name>'; nested scopes are
    # possible ('<primary>/<scope>/<slot>'): try every '/' split.
    match = None
    parts = v.op.name.split('/')
    for k in range(len(parts) - 1, 0, -1):
      owner, slot = '/'.join(parts[:k]), '/'.join(parts[k:])
      if owner in stacked:
        match = (owner, slot)
        break
    if match is None or stacked[match[0]][0] is v:
      keep.append(v)
      continue
    var, names = stacked[match[0]]
    if v.shape != var.shape:
      keep.append(v)
      continue
    names = [n + '/' + match[1] for n in names]
    stacked[v.op.name] = (v, names)
    new_views.append((v, names))
    graph.add_to_collection(STACKED_VARIABLES + '_slots', v)
    count += 1
  global_vars[:] = keep
  for v, names in new_views:
    _AddViews(v, names)
  return count
