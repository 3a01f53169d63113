"""Data-parallel step time and bytes per step of each gradient_sync strategy.

The LM with a large word vocabulary (its embedding gets sparse gradients, its
softmax dense ones) runs as R=2 replicas on 2 logical CPU devices under every
`PipelinedTask.gradient_sync`, plus 'all_reduce' with fp16 compression, all
from the same weights, their steps taken in turn (round robin) in one process,
so load that comes and goes hits every strategy alike. For each it reports the
median step time and the bytes one replica sends per step, from the graph's
static shapes (`GradientSync.stats`): dense gradients into CollectiveReduce,
sparse ones (values and indices) into CollectiveGather, what all-reducing
those sparse gradients dense would have sent, and the gradients pushed into
parameter server accumulators. The fp16 row also gives the largest weight difference
from the float32 'all_reduce' run after the timed steps.

  .venv/bin/python bench/data_parallel.py               # JSON lines
  .venv/bin/python bench/data_parallel.py --markdown    # a markdown table
  .venv/bin/python bench/data_parallel.py --quick       # tiny sizes, a few steps

See docs/benchmarks.md for the recorded table.
"""

import os
import statistics
import sys
import zlib

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-import-not-at-top,g-bad-import-order

# isort: split
import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
from lingvo.core import optimizer  # pylint: disable=g-import-not-at-top
from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from bench import harness  # pylint: disable=g-import-not-at-top
from lingvo_ext.distributed import sync  # pylint: disable=g-import-not-at-top
from params import lm  # pylint: disable=g-import-not-at-top

py_utils.SetEagerMode(False)

REPLICAS = 2
CONFIGS = [(s, 'none') for s in sync.STRATEGIES] + [('all_reduce',
                                                               'fp16')]


def _TaskParams(args, strategy, compression):
  e = lm.TransformerLmTiny()
  p = e.Task()
  p.input = e.Train()
  p.input.Set(unit='word', vocab_size=args.vocab_size, seq_len=args.seq_len,
              batch_size=args.batch_size)
  p.Set(vocab_size=args.vocab_size, model_dim=args.model_dim,
        hidden_dim=4 * args.model_dim, gradient_sync=strategy,
        gradient_compression=compression)
  p.train.optimizer = optimizer.SGD.Params()
  p.train.learning_rate = 0.1
  p.train.clip_gradient_norm_to_value = 0.0
  return p


class Run:
  """One strategy's graph and session, stepped on demand (round robin)."""

  def __init__(self, args, strategy, compression):
    self.strategy, self.compression = strategy, compression
    p = _TaskParams(args, strategy, compression)
    self.graph = tf.Graph()
    cluster = cluster_factory.ForTestingWorker(
        mode='sync', job='trainer_client', cpus=REPLICAS, split_size=1)
    cluster.params.ps.cpus_per_replica = REPLICAS
    with self.graph.as_default(), cluster:
      py_utils.GetOrCreateGlobalStepVar()
      self.task = p.Instantiate()
      self.task.FPropDefaultTheta()
      self.task.BProp()
      init = [tf.global_variables_initializer(),
              tf.local_variables_initializer()]
      config = tf.config_pb2.ConfigProto(
          device_count={'CPU': REPLICAS}, inter_op_parallelism_threads=4,
          intra_op_parallelism_threads=1)
      self.sess = tf.Session(graph=self.graph, config=config)
      self.sess.run(init)
      for v in self.task.vars.Flatten():
        rng = np.random.RandomState(zlib.crc32(v.op.name.encode()))
        v.load((rng.randn(*v.shape.as_list()) * 0.05).astype(np.float32),
               self.sess)
    self.Step()  # Warm-up (and the replicas' first copy).
    self.times = []

  def Step(self):
    self.sess.run(self.task.train_op)

  def Row(self, args):
    """The result row and the weights; closes the session."""
    weights = {v.op.name: self.sess.run(v) for v in self.task.vars.Flatten()}
    self.sess.close()
    task_sync = self.task.gradient_sync
    stats = task_sync.stats if task_sync else sync.CommunicationStats()
    row = dict(
        strategy=self.strategy,
        compression=self.compression,
        replicas=REPLICAS,
        vocab_size=args.vocab_size,
        step_ms=round(1000 * statistics.median(self.times), 1),
        dense_all_reduce_bytes=stats.dense_all_reduce_bytes,
        sparse_all_gather_bytes=stats.sparse_all_gather_bytes,
        sparse_densified_bytes=stats.sparse_densified_bytes,
        ps_push_bytes=stats.ps_push_bytes)
    return row, weights


def main(argv=None):
  parser = harness.Parser(__doc__)
  parser.add_argument('--vocab_size', type=int, default=16384)
  parser.add_argument('--model_dim', type=int, default=64)
  parser.add_argument('--seq_len', type=int, default=32)
  parser.add_argument('--batch_size', type=int, default=8,
                      help='Examples per replica.')
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--quick', action='store_true',
                      help='Tiny sizes and 3 steps (for tests).')
  args = parser.parse_args(argv)
  if args.quick:
    args.vocab_size, args.model_dim, args.seq_len = 512, 16, 8
    args.batch_size, args.steps = 2, 3
  runs = [Run(args, strategy, compression) for strategy, compression in CONFIGS]
  # Round robin: load that comes and goes on the machine hits every strategy.
  for run, times in zip(runs, harness.RoundRobin([r.Step for r in runs],
                                                 args.steps)):
    run.times = times
  rows, reference = [], None
  for run in runs:
    row, weights = run.Row(args)
    strategy, compression = run.strategy, run.compression
    if (strategy, compression) == ('all_reduce', 'none'):
      reference = weights
    if compression == 'fp16':
      row['fp16_max_weight_error'] = float(
          max(np.abs(weights[k] - reference[k]).max() for k in weights))
    rows.append(row)
  harness.Emit(args, rows, lambda rows: Markdown(rows, args.steps))
  return 0


def Markdown(rows, steps: int) -> str:
  """The table, and the fp16 run's largest weight difference."""
  table = harness.Table(
      ('gradient_sync', 'step (ms)', 'dense all-reduce B',
       'sparse all-gather B', 'sparse densified B', 'ps push B'),
      [(r['strategy'] + (' + fp16' if r['compression'] == 'fp16' else ''),
        r['step_ms'], f"{r['dense_all_reduce_bytes']:,}",
        f"{r['sparse_all_gather_bytes']:,}",
        f"{r['sparse_densified_bytes']:,}", f"{r['ps_push_bytes']:,}")
       for r in rows])
  for r in rows:
    if 'fp16_max_weight_error' in r:
      table += (f'\n\nfp16: largest weight difference from float32 '
                f'all_reduce after {steps + 1} steps: '
                f"{r['fp16_max_weight_error']:.2e}")
  return table


if __name__ == '__main__':
  sys.exit(main())
