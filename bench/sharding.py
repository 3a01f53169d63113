"""Word LM with its embedding and softmax partitioned 1, 2 and 4 ways.

Builds the layer stack of a registered word LM (default lm.WordLm: 4096
words, 2 Transformer layers of width 256) three times in one process, with
`partitioner=('fixed_size', dict(num_shards=k))` for k = 2, 4 and None for
k = 1, each in its own graph and session on 4 logical CPU devices (the model
split: shard i goes to device i mod 4; the other layers stay on device 0).
A training step is the LM's cross-entropy on a fixed batch and one Adam
update. The timed steps alternate the three models round-robin, and the
median is reported.

Memory per device, from one traced step of each model:
  resident_mb   variables and Adam slots placed on the device (from the
                graph: shapes x dtype sizes);
  peak_step_mb  the highest sum of live step-allocated tensor bytes on the
                device during the step (from the allocation records of
                RunMetadata's step stats);
  peak_mb       resident_mb + peak_step_mb.

  .venv/bin/python bench/sharding.py              # JSON lines
  .venv/bin/python bench/sharding.py --markdown   # a markdown table
  .venv/bin/python bench/sharding.py --quick      # lm.WordLmTiny, few steps

See docs/benchmarks.md for what the numbers mean.
"""

import collections
import os
import statistics
import sys
import time
from typing import Dict
from typing import List

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-import-not-at-top,g-bad-import-order

# isort: split
from lingvo import model_registry  # pylint: disable=g-import-not-at-top
import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from bench import harness  # pylint: disable=g-import-not-at-top
import params  # pylint: disable=unused-import,g-import-not-at-top

py_utils.SetEagerMode(False)

NUM_DEVICES = 4
SHARDS = (1, 2, 4)


def SessionConfig():
  return tf.config_pb2.ConfigProto(
      device_count={'CPU': NUM_DEVICES}, inter_op_parallelism_threads=2,
      intra_op_parallelism_threads=1)


def _DeviceIndex(device: str) -> int:
  """'/job:localhost/replica:0/task:0/device:CPU:3' -> 3; '' -> 0."""
  if not device:
    return 0
  return int(tf.DeviceSpec.from_string(device).device_index or 0)


class Step:
  """One word LM training step with its vocabulary tables in k shards."""

  def __init__(self, model: str, num_shards: int):
    self.num_shards = num_shards
    mp = model_registry.GetParams(model, 'Train')
    task_p = mp.task.Copy()
    task_p.input = mp.input.Copy()
    task_p.partitioner = (None if num_shards == 1 else
                          ('fixed_size', dict(num_shards=num_shards)))
    stack, shapes = task_p.cls.LayerStack(task_p)
    batch, seq_len = shapes[0].ToTensorShape().as_list()
    self.graph = tf.Graph()
    with self.graph.as_default(), cluster_factory.ForTestingWorker(
        mode='sync', job='trainer_client', cpus=NUM_DEVICES,
        split_size=NUM_DEVICES):
      tf.random.set_seed(1234)
      rng = np.random.RandomState(0)
      ids = tf.constant(
          rng.randint(0, task_p.vocab_size, [batch, seq_len]).astype(np.int32))
      labels = tf.constant(
          rng.randint(0, task_p.vocab_size, [batch, seq_len]).astype(np.int32))
      layers = [p.Instantiate() for p in stack]
      x = ids
      for l in layers:
        x = l.FProp(l.theta, x)
      self.loss = tf.reduce_mean(
          tf.nn.sparse_softmax_cross_entropy_with_logits(
              labels=labels, logits=x))
      variables = []
      for l in layers:
        variables += l.vars.Flatten()
      opt = tf.train.AdamOptimizer(1e-3)
      self.train = opt.minimize(self.loss, var_list=variables)
      self.resident = collections.Counter()
      for v in tf.global_variables():
        n = v.shape.num_elements() * v.dtype.base_dtype.size
        self.resident[_DeviceIndex(v.device)] += n
      self.num_params = sum(v.shape.num_elements() for v in variables)
      init = tf.global_variables_initializer()
    self.sess = tf.Session(graph=self.graph, config=SessionConfig())
    self.sess.run(init)
    self.sess.run(self.train)  # Warm-up.

  def Run(self) -> float:
    t0 = time.perf_counter()
    self.sess.run(self.train)
    return time.perf_counter() - t0

  def PeakStepBytes(self) -> Dict[int, int]:
    """Per device, the peak of live step-allocated bytes in a traced step."""
    opts = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
    meta = tf.RunMetadata()
    self.sess.run(self.train, options=opts, run_metadata=meta)
    events = collections.defaultdict(list)
    for dev in meta.step_stats.dev_stats:
      index = _DeviceIndex(dev.device)
      for node in dev.node_stats:
        for mem in node.memory:
          for rec in mem.allocation_records:
            events[index].append((rec.alloc_micros, rec.alloc_bytes))
    peaks = {}
    for index, evs in events.items():
      live = peak = 0
      for _, delta in sorted(evs):
        live += delta
        peak = max(peak, live)
      peaks[index] = peak
    return peaks

  def Close(self):
    self.sess.close()


def RunBench(model: str, num_steps: int) -> List[Dict]:
  steps = {k: Step(model, k) for k in SHARDS}
  times = collections.defaultdict(list)
  for _ in range(num_steps):
    for k, s in steps.items():
      times[k].append(s.Run())
  records = []
  for k, s in steps.items():
    peaks = s.PeakStepBytes()
    per_device = []
    for d in range(NUM_DEVICES):
      resident = s.resident.get(d, 0)
      step = peaks.get(d, 0)
      per_device.append({
          'device': d,
          'resident_mb': resident / 2**20,
          'peak_step_mb': step / 2**20,
          'peak_mb': (resident + step) / 2**20,
      })
    records.append({
        'model': model,
        'num_shards': k,
        'num_params': s.num_params,
        'step_ms': 1e3 * statistics.median(times[k]),
        'num_steps': num_steps,
        'devices': per_device,
    })
    s.Close()
  return records


def Markdown(records: List[Dict]) -> str:
  header = ['shards', 'step (ms)'] + [
      'dev %d peak MB (resident + step)' % d for d in range(NUM_DEVICES)]
  return harness.Table(header, [
      [r['num_shards'], '%.1f' % r['step_ms']] +
      ['%.1f (%.1f + %.1f)' % (d['peak_mb'], d['resident_mb'],
                               d['peak_step_mb']) for d in r['devices']]
      for r in records])


def main(argv=None) -> int:
  parser = harness.Parser(__doc__)
  parser.add_argument('--model', default='lm.WordLm')
  parser.add_argument('--num_steps', type=int, default=20)
  parser.add_argument('--quick', action='store_true',
                      help='lm.WordLmTiny, 3 steps.')
  args = parser.parse_args(argv)
  flags = tf.flags.FLAGS
  if not flags.is_parsed():
    flags.mark_as_parsed()
  model, num_steps = args.model, args.num_steps
  if args.quick:
    model, num_steps = 'lm.WordLmTiny', 3
  records = RunBench(model, num_steps)
  harness.Emit(args, records, Markdown)
  return 0


if __name__ == '__main__':
  sys.exit(main())
