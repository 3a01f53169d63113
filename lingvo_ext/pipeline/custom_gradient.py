"""A custom gradient for a whole pipeline, looked up by the closing op's name.

The engine closes each pipeline's forward pass with an IdentityN whose
gradient is the engine's backward function (`WithBackward`): tf.gradients
calls it with the outputs' gradients when it builds the backward pass, so
the engine sees the caller's loss before choosing the backward lists.
tf.custom_gradient does the same in graph mode, but registers a new gradient
name per call in TensorFlow's process-wide registry and checks the variables
its function reads; here one name serves every pipeline, and the backward
functions live in graph state, freed with the graph.
"""

from typing import Callable
from typing import List

import lingvo.compat as tf

from lingvo_ext.pipeline import graph_state

# Gradient of the IdentityN that closes each engine-built pipeline; the
# backward function of every such op is looked up by the op's name.
_PIPELINE_GRAD_NAME = 'LingvoExtPipelineBackward'
# Graph state (graph_state, freed with the graph): op name -> fn.
_BACKWARD_FNS = 'pipeline_backward_fns'


@tf.RegisterGradient(_PIPELINE_GRAD_NAME)
def _PipelineBackward(op, *grads):
  fn = graph_state.Peek(op.graph, _BACKWARD_FNS)[op.name]
  return fn(list(grads))


def WithBackward(inputs: List, outputs: List, backward_fn: Callable) -> List:
  """Returns `outputs`, whose gradient is `backward_fn` instead of autodiff.

  Args:
    inputs: Tensors the outputs depend on (the pipeline's inputs, weights).
    outputs: Tensors computed from them.
    backward_fn: Takes the gradients of `outputs` (None where the caller's
      loss does not depend on one) and returns those of `inputs`.

  Returns:
    Identities of `outputs`. Autodiff does not look inside: the forward
    pass's internal tensors are kept only if `backward_fn` uses them.
  """
  graph = tf.get_default_graph()
  with graph.gradient_override_map({'IdentityN': _PIPELINE_GRAD_NAME}):
    ids = tf.identity_n(list(inputs) + list(outputs))
  n = len(inputs)

  def _Backward(grads):
    in_grads = backward_fn(grads[n:])
    return list(in_grads) + [None] * len(outputs)

  graph_state.Get(graph, _BACKWARD_FNS, dict)[ids[0].op.name] = _Backward
  return ids[n:]
