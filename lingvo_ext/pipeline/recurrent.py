"""Lingvo's StackedRecurrent loop over micro-batches ('recurrent').

With the packing of cell inputs and outputs into the NestedMap states the
loop passes between cells (`ToState`, `FromState`).
"""

import lingvo.compat as tf
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils
from lingvo.core import recurrent

from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext.pipeline.nest_util import Flat as _Flat
from lingvo_ext.pipeline.nest_util import ToTuple
from lingvo_ext.pipeline.tensors import CastHere

_MICRO_BATCH_STATE_NAME = 'micro_batch_state'


def Recurrent(layer, theta, inputs, num_micro):
  """Lingvo's StackedRecurrent loop over micro-batches (always recomputes)."""
  p = layer.params
  cells = layer.Cells()
  num_cells = len(cells)
  micro_batch_size = None
  for x in _Flat(inputs):
    if x is not None:
      micro_batch_size = x.shape.as_list()[p.batch_dim] // num_micro
      break
  state_dtype = layer.StateDtype(inputs)
  if p.fprop_dtype is not None:
    # Cells that compute in fprop_dtype (Lingvo's mixed precision, e.g.
    # bfloat16) pass their outputs on in it, and StackedRecurrent takes one
    # dtype for all of a cell's states, the micro-batch step included (in
    # bfloat16 exact up to 256, as with Lingvo's state_dtype=tf.bfloat16).
    state_dtype = p.fprop_dtype
  state_shapes = layer.StateShapes(inputs, micro_batch_size,
                                    after_before_layers=True)
  devices = layer.Devices()

  def _CellFn(i):
    """The step function of cell i inside StackedRecurrent."""

    def CellFn(theta, state0, inputs):
      del state0

      def _SetShape(name, t_shape):
        if t_shape is None:
          return None
        t = inputs.GetItem(name)
        t.set_shape(t_shape.ToTensorShape().as_list())
        return t

      fprop_inputs = layer.FromState(inputs, state_shapes[i], _SetShape)
      with py_utils.RemoveAssertContext(remove=True):
        with lingvo_gpipe.CellFnFPropOpReplacementWrapper():
          mb_tensor = inputs[_MICRO_BATCH_STATE_NAME]
          lingvo_gpipe.SetOverWriteGlobalStep(mb_tensor)
          _, cell = cells[i]
          outputs = cell.FProp(theta, *ToTuple(fprop_inputs))
      if not p.nested_map_fprop and (len(ToTuple(outputs)) != len(
          state_shapes[i + 1])):
        raise ValueError(
            '%s: cell %d returned %d outputs but its FPropMeta says %d.' %
            (p.name, i, len(ToTuple(outputs)), len(state_shapes[i + 1])))
      state1 = layer.ToState(outputs)
      state1[_MICRO_BATCH_STATE_NAME] = mb_tensor
      return state1, py_utils.NestedMap()

    return CellFn

  def _Zeros(t_shape):
    if t_shape is None:
      return None
    return tf.zeros(t_shape.ToTensorShape().as_list(), dtype=state_dtype)

  init_states = []
  for i in range(num_cells):
    if p.nested_map_fprop:
      init_state = py_utils.Transform(_Zeros, state_shapes[i + 1])
    else:
      init_state = tuple(_Zeros(s) for s in state_shapes[i + 1])
    init_state = layer.ToState(init_state)
    init_state[_MICRO_BATCH_STATE_NAME] = tf.cast(0, dtype=state_dtype)
    init_states.append(init_state)

  with tf.device(devices[0]):

    def _Split(x):
      if x is None:
        return None
      return tf.stack(tf.split(x, num_micro, axis=p.batch_dim))

    if p.nested_map_fprop:
      states = layer.ToState(py_utils.Transform(_Split, inputs[0]))
    else:
      states = layer.ToState(tuple(_Split(x) for x in inputs))
    states[_MICRO_BATCH_STATE_NAME] = tf.stack(
        layer.MicroBatchSteps(num_micro, state_dtype))

  cell_thetas = []
  for i, (name, _) in enumerate(cells):
    with tf.device(devices[i]):
      cell_thetas.append(theta[name].Transform(CastHere))

  output_state, _ = recurrent.StackedRecurrent(
      devices=devices,
      cell_fns=[_CellFn(i) for i in range(num_cells)],
      cell_grads=[None] * num_cells,
      cell_outs=[lambda x: x] * num_cells,
      cell_out_grads=[lambda x: x] * num_cells,
      thetas=cell_thetas,
      init_states=init_states,
      inputs=states,
      accumulator_layers=[cell for _, cell in cells],
      unused_acc_state=True)

  with tf.device(devices[-1]):

    def _Merge(name, t_shape):
      """[M, micro-batch...] -> the batch, with batch_dim restored."""
      if t_shape is None:
        return None
      out = output_state.GetItem(name)
      if p.batch_dim != 0:
        perm = list(range(1, p.batch_dim + 1)) + [0]
        perm += list(range(p.batch_dim + 1, t_shape.rank + 1))
        out = tf.transpose(out, perm=perm)
      shape = t_shape.ToTensorShape().as_list()
      shape[p.batch_dim] *= num_micro
      return tf.reshape(out, shape)

    outputs = layer.FromState(output_state, state_shapes[-1], _Merge)
  if not p.nested_map_fprop and len(outputs) == 1:
    return outputs[0]
  return outputs



def ToState(nested_map_fprop: bool, values):
  """Packs cell inputs/outputs into the NestedMap StackedRecurrent passes."""
  if nested_map_fprop:
    return values.Filter(lambda x: x is not None)
  state = py_utils.NestedMap()
  for i, v in enumerate(ToTuple(values)):
    if v is not None:
      state['s%d' % i] = v
  return state


def FromState(nested_map_fprop: bool, state, shapes, fn):
  """Inverse of ToState: fn(name, tshape) of each present entry.

  `state` is unused but for the structure `fn` reads; kept for Lingvo's
  signature.
  """
  del state
  if nested_map_fprop:
    return internal_lingvo.RecursiveMap(shapes, fn)
  return tuple(fn('s%d' % i, s) for i, s in enumerate(shapes))
