"""Per-micro-batch random seeds: a cell built inline draws as in Lingvo's loop.

Lingvo's PipeliningLayer runs each cell inside StackedRecurrent with the
global step overwritten by the micro-batch's step; stateless random ops (e.g.
DeterministicDropoutLayer) seed from it and from their name scope within the
cell. `CellRandomness` gives a cell built inline the same seeds, so every
schedule draws the dropout streams Lingvo's loop draws.
"""

import contextlib

import lingvo.compat as tf
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils

from lingvo_ext._internal import lingvo as internal_lingvo


def _CellStepSeedPair(p, unused_global_step=None, op_seed=None, *, prefix):
  """Lingvo's in-cell seed pair, for a cell built under name scope `prefix`.

  Inside StackedRecurrent a cell is traced in its own function graph, so the
  seed it takes from its 'op_seed' name scope has no outer scope in it. Built
  inline, the cell's ops sit under `prefix`; stripping it gives the name, and
  so the seed, that the same op gets in Lingvo's loop.

  Args:
    p: The calling layer's params (random_seed, is_inference).
    unused_global_step: Lingvo's signature; the step comes from
      GetOverWriteGlobalStep (the micro-batch's step).
    op_seed: An extra op-level seed, as in py_utils.GenerateStepSeedPair.
    prefix: The name scope the cell is built in, ending with '/'.

  Returns:
    A [2] seed tensor for stateless random ops.
  """
  seed_dtype = tf.int32 if py_utils.use_tpu() else tf.int64
  if p.is_inference and p.random_seed is None:
    # As Lingvo: an exported inference graph without a seed stays random.
    return tf.random.uniform([2], maxval=seed_dtype.max, dtype=seed_dtype)
  with tf.name_scope('op_seed') as scope:
    if scope.startswith(prefix):
      scope = scope[len(prefix):]
    step = tf.cast(lingvo_gpipe.GetOverWriteGlobalStep(), seed_dtype)
    name_seed = tf.cast(py_utils.GenerateSeedFromName(scope), seed_dtype)
    seeds = tf.stack([step, name_seed])
    if p.random_seed is not None:
      seeds += p.random_seed
    if op_seed is not None:
      seeds += tf.cast(op_seed, seed_dtype)
    return seeds


@contextlib.contextmanager
def CellRandomness(micro_batch_step, scope):
  """Random ops of a cell built inside seed as in Lingvo's pipeline loop.

  Lingvo's PipeliningLayer runs each cell under CellFnFPropOpReplacementWrapper
  with the global step overwritten by the micro-batch's step
  (global_step * num_micro_batches + t): stateless random ops (e.g.
  DeterministicDropoutLayer) seed from it and from their name scope within
  the cell. Schedules that build cells inline, not in StackedRecurrent, wrap
  each (cell, micro-batch) FProp in this to get the same random streams.

  Args:
    micro_batch_step: The micro-batch's step tensor, in the state dtype as
      Lingvo passes it.
    scope: Name of a fresh name scope to build the cell in.

  Yields:
    The name scope string (ending with '/').
  """
  graph = tf.get_default_graph()
  collection = graph.get_collection_ref(
      internal_lingvo.OVERWRITE_GLOBAL_STEP_COLLECTION)
  saved_collection = list(collection)
  with tf.name_scope(scope) as prefix:
    try:
      lingvo_gpipe.SetOverWriteGlobalStep(micro_batch_step, graph)
      with internal_lingvo.StepSeedPairFn(
          lambda *a, **kw: _CellStepSeedPair(*a, prefix=prefix, **kw)):
        yield prefix
    finally:
      collection[:] = saved_collection
