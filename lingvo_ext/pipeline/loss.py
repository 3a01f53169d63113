"""What the caller's loss lets a pipeline's backward lists do.

tf.gradients hands the pipeline its outputs' gradients when it builds the
backward pass. Whether they depend on the pipeline's own forward pass (a loss
not linear in the outputs: no output gradient before every forward pass
ends) decides, per the schedule's record, whether to recompute and whether
each device's forward actions go first.
"""

import sys

import lingvo.compat as tf

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.pipeline import records
from lingvo_ext.pipeline import transforms
from lingvo_ext.pipeline.simulate import CheckSchedule

# The notes printed in this process: each once, however many graphs.
_noted = set()


def DependsOnForward(out_grads, first_id: int, last_id: int) -> bool:
  """Whether the output gradients read an op of ids [first_id, last_id].

  They do not when the loss is linear in the outputs with static shapes
  (e.g. per-example losses from the last cell, summed): then a
  micro-batch's backward pass may start before later forward passes end.
  """
  stack = []
  for g in out_grads:
    if isinstance(g, tf.IndexedSlices):
      stack += [t.op for t in (g.values, g.indices, g.dense_shape)
                if t is not None]
    elif g is not None:
      stack.append(g.op)
  seen = set(stack)
  while stack:
    op = stack.pop()
    if first_id <= internal_tf.OpId(op) <= last_id:
      return True
    for parent in [t.op for t in op.inputs] + list(op.control_inputs):
      if parent not in seen:
        seen.add(parent)
        stack.append(parent)
  return False


def DropZeroGrads(out_grads, pipeline_op):
  """`out_grads` with None for the zeros tf.gradients makes up.

  tf.gradients gives an output it has no gradient for zeros_like(output)
  when another output has one: no gradient, and no wait for the output.
  """
  return [
      None if isinstance(g, tf.Tensor) and g.op.type == 'ZerosLike' and
      g.op.inputs[0].op is pipeline_op else g
      for g in out_grads
  ]


def Recompute(record: records.Schedule, recompute, depends: bool,
              layer_name: str) -> bool:
  """The layer's `recompute` (None, True, False) decided for this loss."""
  if recompute is None:
    # WHEN_NEEDED ('1f1b'): only when the forward passes of all
    # micro-batches must end before any backward pass starts.
    if record.recompute == records.WHEN_NEEDED:
      return depends
    return record.recompute == records.ALWAYS
  if (recompute is False and depends and
      record.nonlinear_loss == records.NEEDS_RECOMPUTE):
    raise ValueError(
        "%s: schedule=%r with recompute=False needs output gradients "
        "that do not depend on the pipeline's outputs (a loss linear in "
        'them, e.g. per-example losses from the last cell, summed); this '
        'loss is not: set recompute=None (recompute when needed) or True.'
        % (layer_name, record.name))
  return recompute


def Lists(record: records.Schedule, spec, depends: bool, layer_name: str):
  """The record's lists for `spec`; for a loss that `depends` on the forward
  pass, each device's forward actions first (`transforms.ForwardsFirst`)."""
  schedule = records.Build(record.name, spec)
  forwards_first = transforms.ForwardsFirst(schedule)
  if depends and forwards_first != schedule:
    Note(NonlinearNote(layer_name, record.name))
    schedule = forwards_first
    CheckSchedule(records.Placed(record.name, spec), schedule)
  return schedule


def NonlinearNote(layer_name: str, schedule: str) -> str:
  """The console's note for a schedule that runs forward passes first."""
  return (
      f"note: {layer_name}: the loss is not linear in the pipeline's "
      f'outputs; schedule {schedule!r} runs every forward pass before its '
      'backward actions (a slower step; per-example losses from the last '
      'cell avoid it, e.g. GPipeTransformerStack loss_in_last_cell=True: '
      'docs/schedules.md).')


def Note(line: str):
  """`line` in the log, and on stderr once per process."""
  tf.logging.info('%s', line)
  if line not in _noted:
    _noted.add(line)
    print(line, file=sys.stderr, flush=True)
