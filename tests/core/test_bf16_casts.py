"""In bf16 each weight is cast once a step each way, whatever M."""

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from tests.core.test_bf16 import B
from tests.core.test_bf16 import D
from tests.core.test_bf16 import _Cells
from tests.core.test_bf16 import _LinearLoss
from tests.support import gpipe_testlib as lib


def _ReachedCasts(fetches):
  """(src dtype, dst dtype) -> Casts the fetches run in the outer graph."""
  seen, stack = set(), [t.op for t in fetches]
  casts = {}
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    if op.type == 'Cast':
      key = (op.inputs[0].dtype.name, op.outputs[0].dtype.name)
      casts.setdefault(key, []).append(op.name)
    stack += [t.op for t in op.inputs] + list(op.control_inputs)
  return casts


@pytest.mark.parametrize('schedule,recompute,functions', [
    ('unrolled', False, True), ('1f1b', None, True), ('unrolled', True, True),
    ('unrolled', False, False)])
def test_each_weight_is_cast_once_a_step_each_way(schedule, recompute,
                                                  functions):
  # Every micro-batch's call (and a recomputed forward) reads one bfloat16
  # copy of each weight, cast once a step on the cell's device; each
  # weight's gradient is cast back to float32 once, after its micro-batches
  # are summed in bfloat16: 2 casts per weight a step whatever M.
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_Cells(2), num_micro_batches=4,
        schedule=schedule, recompute=recompute, fprop_dtype=tf.bfloat16,
        state_dtype=tf.float32, cell_functions=functions).Instantiate()
    x = tf.constant(np.random.RandomState(1).randn(B, D), tf.bfloat16)
    variables = net.vars.Flatten()
    grads = tf.gradients(_LinearLoss(net.FPropDefaultTheta(x)), variables,
                         colocate_gradients_with_ops=True)
  casts = _ReachedCasts(grads)
  assert len(variables) == 4  # 2 cells x (weight, bias).

  def Variable(t):
    while t.op.type in ('Identity', 'ReadVariableOp'):
      t = t.op.inputs[0]
    return t.op.name if t.op.type == 'VarHandleOp' else None
  read = [Variable(g.get_operation_by_name(n).inputs[0])
          for n in casts[('float32', 'bfloat16')]]
  read = sorted(v for v in read if v is not None)
  assert read == sorted(v.handle.op.name for v in variables), casts
  # Each gradient is the one cast back of its bfloat16 sum.
  assert all(d.op.type == 'Cast' and d.op.inputs[0].dtype == tf.bfloat16
             for d in grads), grads
  assert len(casts[('bfloat16', 'float32')]) == len(variables), casts
