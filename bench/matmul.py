"""Is bfloat16 worth it on this CPU? One matmul's GFLOP/s, float32 and bf16.

Times [batch x width] x [width x width] matmuls (10 chained in one graph,
each scaled so values stay finite) in float32 and in bfloat16, steps of the
two alternating in one process, on --threads intra-op threads, and reports
each dtype's GFLOP/s and their ratio, with whether oneDNN is on
(TF_ENABLE_ONEDNN_OPTS) and whether the CPU lists bfloat16 units
(`lingvo_ext.core.precision.CpuHasBf16Units`): the two things that decide
whether `task.fprop_dtype:bfloat16` trains faster here.

  .venv/bin/python bench/matmul.py                 # 128 x 1536, 1 thread
  .venv/bin/python bench/matmul.py --threads 2 --markdown
  TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python bench/matmul.py

See docs/benchmarks.md ("bf16") for the numbers.
"""

import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-import-not-at-top,g-bad-import-order

# isort: split
import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

from bench import harness  # pylint: disable=g-import-not-at-top
from lingvo_ext.core import precision  # pylint: disable=g-import-not-at-top

CHAIN = 10  # Matmuls per step.


def Measure(width=1536, batch=128, threads=1, steps=10, warmup=2):
  """One record per dtype: GFLOP/s over the median step, and the ratio."""
  py_utils.SetEagerMode(False)
  graph = tf.Graph()
  outs = {}
  with graph.as_default():
    for dtype in (tf.float32, tf.bfloat16):
      x = tf.cast(tf.random.normal([batch, width], seed=1), dtype)
      w = tf.cast(tf.random.normal([width, width], seed=2), dtype)
      w = tf.Variable(w, name='w_' + dtype.name)
      scale = tf.cast(1.0 / width**0.5, dtype)
      y = x
      for _ in range(CHAIN):
        y = tf.matmul(y, w) * scale
      outs[dtype.name] = tf.reduce_sum(tf.cast(y, tf.float32))
    init = tf.global_variables_initializer()
  config = tf.config_pb2.ConfigProto(
      inter_op_parallelism_threads=1, intra_op_parallelism_threads=threads)
  times = {name: [] for name in outs}
  with tf.Session(graph=graph, config=config) as sess:
    sess.run(init)
    for i in range(warmup + steps):
      for name, out in outs.items():
        start = time.perf_counter()
        sess.run(out)
        if i >= warmup:
          times[name].append(time.perf_counter() - start)
  flops = 2.0 * batch * width * width * CHAIN
  gflops = {n: flops / statistics.median(t) / 1e9 for n, t in times.items()}
  common = dict(width=width, batch=batch, threads=threads, steps=steps,
                onednn=precision.OneDnnEnabled(),
                cpu_bf16_units=precision.CpuHasBf16Units())
  # Significant digits, not decimals: a loaded machine's tiny run is still
  # a positive rate, not 0.0.
  return [dict(common, dtype=n, gflops=float('%.4g' % g),
               vs_float32=float('%.4g' % (g / gflops['float32'])))
          for n, g in gflops.items()]


def Markdown(records):
  return harness.Table(
      ('width', 'batch', 'threads', 'dtype', 'GFLOP/s', 'x float32', 'oneDNN',
       'CPU bf16 units'),
      [(r['width'], r['batch'], r['threads'], r['dtype'],
        '%.1f' % r['gflops'], '%.2f' % r['vs_float32'], r['onednn'],
        r['cpu_bf16_units']) for r in records])


def main(argv=None):
  parser = harness.Parser(__doc__)
  parser.add_argument('--width', type=int, default=1536)
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--threads', type=int, default=1,
                      help='Intra-op threads.')
  parser.add_argument('--steps', type=int, default=10,
                      help='Timed steps per dtype.')
  args = parser.parse_args(argv)
  harness.CheckPositive(parser, args, ('width', 'batch', 'threads', 'steps'))
  records = Measure(args.width, args.batch, args.threads, args.steps)
  harness.Emit(args, records, Markdown)
  return 0


if __name__ == '__main__':
  sys.exit(main())
