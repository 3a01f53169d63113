"""'hybrid': dense variables all-reduced, sparse ones through a ps.

A variable read only by gathers (e.g. an embedding table) gets sparse
gradients and goes 'parameter_server'; every other one 'all_reduce'.
"""

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.distributed.sync import all_reduce
from lingvo_ext.distributed.sync import parameter_server


class HybridSync(all_reduce.AllReduceSync,
                 parameter_server.ParameterServerSync, strategy='hybrid'):
  """Per variable: 'ps' if read only by gathers, else 'replicated'."""

  def _PlanOf(self, path):
    return 'ps' if _ReadOnlyByGathers(self._reads[0][path]) else 'replicated'

  def _SyncVariable(self, path, per_replica, var):
    if self._plans[path] == 'ps':
      return self._PushToPs(per_replica, var)
    return self._AllReduce(path, per_replica, var)


def _ReadOnlyByGathers(read):
  """Whether every use of `read` (through identities) is a gather's params.

  Followed into function calls (a pipeline cell built once): a gather there
  exports its rows' gradient, which stays sparse.
  """
  frontier = [read]
  seen = False
  while frontier:
    t = frontier.pop()
    for op in t.consumers():
      if op.type in ('Identity', 'StopGradient'):
        frontier.extend(op.outputs)
      elif op.type == 'IdentityN':  # E.g. a tf.custom_gradient's inputs.
        frontier.extend(
            out for inp, out in zip(op.inputs, op.outputs) if inp is t)
      elif op.type in ('PartitionedCall', 'StatefulPartitionedCall'):
        body = internal_tf.FunctionGraph(op)
        if body is None:
          return False
        frontier.extend(arg for inp, arg in zip(op.inputs, body.inputs)
                        if inp is t)
      elif op.type in ('GatherV2', 'Gather', 'ResourceGather') and (
          op.inputs[0] is t):
        seen = True
      else:
        return False
  return seen
