"""A pipeline cell built once: one TF function called per micro-batch.

`CellFunction` traces a cell's FProp once as a function of (theta, inputs,
micro-batch step, accumulator values) and returns a call per micro-batch, so a
pipeline's graph holds each cell's ops once plus one call op per (cell,
micro-batch), instead of a copy of the cell per micro-batch. TensorFlow
differentiates the call op with the function's own gradient function, also
built once, so the backward pass grows the same way.

Random ops seed as in Lingvo's `StackedRecurrent` loop: the function body is a
graph of its own, so an op's name scope inside it, and so its seed, is the one
it has in Lingvo's loop, and the micro-batch step (an input) replaces the
global step (`lingvo.core.gpipe.SetOverWriteGlobalStep`).
"""

import contextlib
from typing import List

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils
import tensorflow as tf2


def _Flat(structure) -> List:
  return tf.nest.flatten(structure)


def _ToTuple(x):
  if isinstance(x, list):
    return tuple(x)
  return x if isinstance(x, tuple) else (x,)


class CellFunction:
  """One cell's FProp as a function called once per micro-batch.

  The function takes the cell's theta leaves, its present (non-None) inputs,
  the micro-batch step, the global step's value and the cell's accumulator
  values, and returns its
  present outputs and the new accumulator values. It is traced on the first
  call; later calls must give inputs of the same structure, dtypes and
  shapes (every micro-batch of a pipeline does).
  """

  def __init__(self, cell, name: str, jit_compile: bool = False):
    """Constructor.

    Args:
      cell: The cell layer (its FProp takes theta and the cell's inputs).
      name: Name of the function (unique per cell in a graph helps reading).
      jit_compile: Compile the function with XLA.
    """
    self._cell = cell
    self._name = name
    self._jit_compile = jit_compile
    self._fn = None
    self._theta_struct = None
    self._in_struct = None
    self._out_struct = None  # The cell's output structure, None kept.
    self._acc_struct = None

  def _Trace(self, theta, inputs, step):
    """Builds the tf.function for these input structures."""
    cell = self._cell
    self._theta_struct = theta
    self._in_struct = inputs
    self._acc_struct = cell.GetAccumulatorValues()
    n_theta = len(_Flat(theta))
    in_flat = _Flat(inputs)
    present = [i for i, x in enumerate(in_flat) if x is not None]
    n_in = len(present)
    n_acc = len(_Flat(self._acc_struct))
    self._has_global_step = py_utils.GetGlobalStep() is not None

    def Body(*args):
      theta_b = tf.nest.pack_sequence_as(self._theta_struct,
                                         list(args[:n_theta]))
      xs = [None] * len(in_flat)
      for i, x in zip(present, args[n_theta:n_theta + n_in]):
        xs[i] = x
      x_b = tf.nest.pack_sequence_as(self._in_struct, xs)
      step_b = args[n_theta + n_in]
      rest = list(args[n_theta + n_in + 1:])
      # The global step comes in as a value, not as a captured variable
      # (which XLA cannot read from another device).
      global_step = rest.pop(0) if self._has_global_step else None
      accs = rest
      if n_acc:
        cell.SetAccumulatorValues(
            tf.nest.pack_sequence_as(self._acc_struct, list(accs)))
      with contextlib.ExitStack() as stack:
        if global_step is not None:
          stack.enter_context(py_utils.GlobalStepContext(global_step))
        if self._jit_compile:
          # Lingvo's shape asserts and numeric checks have no XLA kernels.
          stack.enter_context(cluster_factory.Current().params.Copy().Set(
              enable_asserts=False,
              enable_check_numerics=False).Instantiate())
        stack.enter_context(lingvo_gpipe.CellFnFPropOpReplacementWrapper())
        lingvo_gpipe.SetOverWriteGlobalStep(step_b)
        stack.enter_context(py_utils.RemoveAssertContext(remove=True))
        out = cell.FProp(theta_b, *_ToTuple(x_b))
      self._out_struct = out
      out_flat = [t for t in _Flat(out) if t is not None]
      new_accs = _Flat(cell.GetAccumulatorValues()) if n_acc else []
      return out_flat + new_accs

    self._fn = tf2.function(Body, autograph=False,
                            jit_compile=self._jit_compile or None)
    self._fn.__name__ = self._name

  def __call__(self, theta, inputs, step):
    """The cell on one micro-batch; updates the cell's accumulators.

    Args:
      theta: The cell's theta (a NestedMap of tensors).
      inputs: The cell's inputs (a tuple; None entries allowed).
      step: The micro-batch step tensor (Lingvo's per-micro-batch step).

    Returns:
      The cell's outputs, in the structure its FProp returns.
    """
    if self._fn is None:
      self._Trace(theta, inputs, step)
    accs = _Flat(self._cell.GetAccumulatorValues())
    args = _Flat(theta) + [x for x in _Flat(inputs) if x is not None]
    args += [step]
    if self._has_global_step:
      args.append(tf.convert_to_tensor(py_utils.GetGlobalStep()))
    args += accs
    results = self._fn(*args)
    results = list(results) if isinstance(results, (list, tuple)) else [
        results]
    n_out = len(results) - len(accs)
    if accs:
      self._cell.SetAccumulatorValues(
          tf.nest.pack_sequence_as(self._acc_struct, results[n_out:]))
    it = iter(results[:n_out])
    flat = [None if t is None else next(it) for t in _Flat(self._out_struct)]
    return tf.nest.pack_sequence_as(self._out_struct, flat)
