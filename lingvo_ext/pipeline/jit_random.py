"""Stateless random draws in an XLA-compiled cell, equal to TensorFlow's.

Lingvo's DeterministicDropoutLayer (py_utils.DeterministicDropout) draws its
masks with `tf.random.stateless_uniform`: StatelessRandomGetKeyCounter turns
the seed pair into a Philox key and counter, StatelessRandomUniformV2 draws
the floats. XLA compiles both, and its key, counter and raw Philox bits
(StatelessRandomUniformFullIntV2 as uint32) equal the CPU kernels'; only the
bits-to-float step differs: TensorFlow's kernel (random_distributions.h,
Uint32ToFloat) puts a draw's low 23 bits in the mantissa of a float in
[1, 2) and subtracts 1, XLA takes the high bits.

`MatchStatelessUniforms` rewrites each StatelessRandomUniformV2 of a traced
body as its raw bits plus TensorFlow's conversion, so a compiled cell draws
the masks its uncompiled build draws, bit for bit (tests/pipeline/test_jit_random.py).
A random op this does not rewrite (another distribution or dtype) is named
by `UnmatchedRandomOps`; the cell function is then built uncompiled.
"""

from typing import List

import lingvo.compat as tf

from lingvo_ext._internal import tf as internal_tf

# Random ops whose draws XLA would make differently from TensorFlow's kernels
# (stateful ones differ anyway, compiled or not, and are left alone).
_STATELESS = ('StatelessRandomUniform', 'StatelessRandomUniformV2',
              'StatelessRandomUniformInt', 'StatelessRandomUniformIntV2',
              'StatelessRandomUniformFullInt',
              'StatelessRandomUniformFullIntV2', 'StatelessRandomNormal',
              'StatelessRandomNormalV2', 'StatelessTruncatedNormal',
              'StatelessTruncatedNormalV2', 'StatelessRandomBinomial',
              'StatelessRandomGammaV2', 'StatelessRandomGammaV3',
              'StatelessRandomPoisson', 'StatelessMultinomial',
              'StatelessParameterizedTruncatedNormal')
# Draws whose bits XLA makes as TensorFlow does (only the conversion to
# floats differs, which MatchStatelessUniforms replaces).
_SAME_BITS = ('StatelessRandomUniformFullIntV2',)


def _Matchable(op) -> bool:
  return (op.type == 'StatelessRandomUniformV2' and
          op.get_attr('dtype') == tf.float32)


def _TfUniform(op):
  """TensorFlow's float32 draw for `op`, built from XLA-exact Philox bits."""
  shape, key, counter, alg = op.inputs
  with tf.name_scope(op.name.split('/')[-1] + '_as_tf'):
    bits = tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=shape, key=key, counter=counter, alg=alg, dtype=tf.uint32)
    mantissa = tf.bitwise.bitwise_or(
        tf.bitwise.bitwise_and(bits, tf.constant(0x7fffff, tf.uint32)),
        tf.constant(0x3f800000, tf.uint32))  # 1.0's exponent.
    return tf.bitcast(mantissa, tf.float32) - 1.0


def MatchStatelessUniforms(ops) -> int:
  """Rewires every float32 StatelessRandomUniformV2 in `ops` to TF's draw.

  Args:
    ops: Operations of one graph (a function body being traced), in creation
      order.

  Returns:
    How many draws were rewired. The replaced ops stay, unused (XLA drops
    them).
  """
  n = 0
  for op in list(ops):
    if not _Matchable(op):
      continue
    y = op.outputs[0]
    uses = [(c, j) for c in y.consumers()
            for j, t in enumerate(c.inputs) if t.ref() == y.ref()]
    if not uses:
      continue
    with tf.control_dependencies(None):
      drawn = _TfUniform(op)
    drawn.set_shape(y.shape)
    for c, j in uses:
      internal_tf.UpdateInput(c, j, drawn)
    n += 1
  return n


def UnmatchedRandomOps(graph) -> List[str]:
  """The stateless random ops of a function graph XLA would draw otherwise.

  Looks in the graph and in the functions it calls (a cond or loop body).
  Rewired draws count once their output has no consumer.
  """
  out = []
  for op in graph.get_operations():
    if op.type in _STATELESS and op.type not in _SAME_BITS:
      if not (_Matchable(op) and not op.outputs[0].consumers()):
        out.append(op.type)
  for fdef in graph.as_graph_def().library.function:
    out += [n.op for n in fdef.node_def
            if n.op in _STATELESS and n.op not in _SAME_BITS]
  return sorted(set(out))
