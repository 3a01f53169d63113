"""Weight gradients over micro-batches: one GEMM of the concatenated rows or
one GEMM per micro-batch accumulated.

The engine computes a weight's gradient over a run of micro-batches as
x^T dy of their rows concatenated (`matmul_grad.WeightGradientBatcher`):
a ConcatV2 of each operand, then one GEMM of inner size M * rows. The other
way is a GEMM per micro-batch, each added to the sum as it comes ('add':
M GEMMs and their adds; 'assign_add': the sum a variable updated in place).
This times the three over one cell's weights of the Transformer ladder
(bench/transformer.py: 2 layers a cell, Lingvo's attention 3 d^2, the
feed-forward d x hidden and back), the variants taken in turn round after
round, on --threads intra-op threads (1: a pipeline device's share).

  .venv/bin/python bench/weight_grad_concat.py --markdown
  .venv/bin/python bench/weight_grad_concat.py --d_model 1024 --hidden 4096 \
      --dtype bfloat16 --markdown
  .venv/bin/python bench/weight_grad_concat.py --bias --markdown

`--bias` adds the gradients of the biases added to those GEMMs' products: a
Sum of each micro-batch's dy over its rows then their AddN, or one
[1, M * rows] GEMM of the dy the weight's gradient concatenated (the
engine's).

See docs/benchmarks.md ("Weight gradients over micro-batches").
"""

import os
import statistics
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-import-not-at-top,g-bad-import-order

# isort: split
import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from bench import harness  # pylint: disable=g-import-not-at-top
from lingvo_ext.pipeline import matmul_grad  # pylint: disable=g-import-not-at-top

VARIANTS = ('concat', 'add', 'assign_add')
# With --bias: the weight gradients ('concat') and those of the biases added
# to the same GEMMs' products (each dy summed over its rows), as a cell's
# backward function reduced them ('sum': a Sum per micro-batch, then their
# AddN) and as the engine does ('gemm': one [1, M * rows] x [M * rows, out]
# GEMM of the dy the weight's gradient concatenated,
# `matmul_grad.BiasGradient`).
BIAS_VARIANTS = ('sum', 'gemm')


def CellWeightShapes(d_model: int, hidden: int, layers: int = 2):
  """[(in, out)] of one cell's weight GEMMs: per layer Lingvo's attention
  (query, key, output: no value projection) and the feed-forward."""
  per_layer = [(d_model, d_model)] * 3 + [(d_model, hidden), (hidden, d_model)]
  return per_layer * layers


def _Gradient(variant, xs, dys, dtype):
  """The weight gradient sum_t xs[t]^T dys[t] the variant's way (a bias
  gradient, the sum of dys' rows, for BIAS_VARIANTS)."""
  if variant in BIAS_VARIANTS:
    dy = tf.concat(dys, 0)
    weight = tf.matmul(tf.concat(xs, 0), dy, transpose_a=True)
    if variant == 'sum':
      return weight, tf.add_n([tf.reduce_sum(d, 0) for d in dys])
    return weight, matmul_grad.BiasGradient(dy)
  if variant == 'concat':
    return tf.matmul(tf.concat(xs, 0), tf.concat(dys, 0), transpose_a=True)
  parts = [tf.matmul(x, dy, transpose_a=True) for x, dy in zip(xs, dys)]
  if variant == 'add':
    total = parts[0]
    for p in parts[1:]:
      total = total + p
    return total
  acc = tf.Variable(tf.zeros(parts[0].shape, dtype), trainable=False)
  op = acc.assign(parts[0])
  for p in parts[1:]:
    with tf.control_dependencies([op]):
      op = acc.assign_add(p)
  with tf.control_dependencies([op]):
    return acc.read_value()


def Measure(d_model=512, hidden=2048, rows=256, num_micro=4,
            dtype='float32', threads=1, steps=10, bias=False):
  """One record per variant: median ms of one cell's weight gradients (and
  its biases' with `bias`; `vs_concat` is then the time over 'sum's)."""
  variants = BIAS_VARIANTS if bias else VARIANTS
  py_utils.SetEagerMode(False)
  tf_dtype = tf.as_dtype(dtype)
  rng = np.random.RandomState(0)
  graph = tf.Graph()
  fetches = {}
  with graph.as_default():
    shapes = CellWeightShapes(d_model, hidden)
    operands = []
    for fan_in, fan_out in shapes:
      def Var(cols):
        return tf.Variable(tf.cast(rng.randn(rows, cols).astype(np.float32),
                                   tf_dtype), trainable=False)
      operands.append(([Var(fan_in) for _ in range(num_micro)],
                       [Var(fan_out) for _ in range(num_micro)]))
    for v in variants:
      outs = [_Gradient(v, [x.read_value() for x in xs],
                        [d.read_value() for d in dys], tf_dtype)
              for xs, dys in operands]
      # The gradients fetched: a group of them Grappler would prune.
      fetches[v] = outs
    init = tf.global_variables_initializer()
  config = tf.config_pb2.ConfigProto(
      inter_op_parallelism_threads=1, intra_op_parallelism_threads=threads)
  with tf.Session(graph=graph, config=config) as sess:
    sess.run(init)
    values = {v: tf.nest.flatten(sess.run(outs))
              for v, outs in fetches.items()}
    times = harness.RoundRobin(
        [lambda outs=outs: sess.run(outs) for outs in fetches.values()],
        steps)
  flops = 2.0 * rows * num_micro * sum((a + bias) * b for a, b in shapes)
  common = dict(d_model=d_model, hidden=hidden, rows=rows, M=num_micro,
                dtype=dtype, threads=threads, steps=steps,
                gflop=float('%.4g' % (flops / 1e9)), **harness.Machine())
  base = statistics.median(times[0])
  records = []
  for v, t in zip(variants, times):
    # The same sums every way, to the dtype's rounding.
    err = max(float(np.max(np.abs(np.float32(a) - np.float32(b)) /
                        (1 + np.abs(np.float32(b)))))
              for a, b in zip(values[v], values[variants[0]]))
    records.append(dict(common, variant=v,
                        ms=round(1e3 * statistics.median(t), 2),
                        vs_concat=round(statistics.median(t) / base, 3),
                        max_rel_diff=float('%.3g' % err)))
  return records


def Markdown(records):
  return harness.Table(
      ('d_model, hidden', 'rows x M', 'dtype', 'threads', 'variant', 'ms',
       'x ' + (records[0]['variant'] if records else 'concat'), 'load'),
      [('%d, %d' % (r['d_model'], r['hidden']), '%d x %d' % (r['rows'], r['M']),
        r['dtype'], r['threads'], r['variant'], '%.2f' % r['ms'],
        '%.3f' % r['vs_concat'], r['load']) for r in records])


def main(argv=None):
  parser = harness.Parser(__doc__)
  parser.add_argument('--d_model', type=int, default=512)
  parser.add_argument('--hidden', type=int, default=2048)
  parser.add_argument('--rows', type=int, default=256,
                      help="A micro-batch's rows (tokens): the ladder's 64 x "
                      '16 / 4.')
  parser.add_argument('--M', type=int, default=4, help='Micro-batches.')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'),
                      default='float32')
  parser.add_argument('--threads', type=int, default=1,
                      help='Intra-op threads.')
  parser.add_argument('--steps', type=int, default=10,
                      help='Rounds, each variant once a round.')
  parser.add_argument('--bias', action='store_true',
                      help="The biases' gradients too (BIAS_VARIANTS).")
  args = parser.parse_args(argv)
  harness.CheckPositive(parser, args,
                        ('d_model', 'hidden', 'rows', 'M', 'threads', 'steps'))
  harness.Emit(args, Measure(args.d_model, args.hidden, args.rows, args.M,
                             args.dtype, args.threads, args.steps,
                             args.bias), Markdown)
  return 0


if __name__ == '__main__':
  sys.exit(main())
