"""The SavedModel's latency against the training graph's forward pass.

For one experiment, side by side in one process on this machine:

- 'saved_model': `lingvo-ext-export`'s SavedModel (the sequential model on
  one device, weights frozen), its `default` signature, loaded with
  `tf.saved_model.load`;
- 'training_forward': the forward pass of the training graph, as the
  trainer builds it (the pipeline over --devices CPU devices, the
  experiment's micro-batches and schedule), on a batch of the same size (the
  smallest multiple of num_micro_batches when the batch does not split).

Each row is the median wall time of --runs calls after --warmup, and the
examples per second it gives. The weights are random (a fresh checkpoint):
the time does not depend on them. It also counts the pipeline ops
(`saved_model.PIPELINE_OP_TYPES`: cell function calls, sends and receives
between devices) in the training graph and in the exported graph (the
inference graph the SavedModel freezes): the exported graph holds none.

  .venv/bin/python bench/serving.py --markdown
  .venv/bin/python bench/serving.py --model=image.ConvClassifierTinyGPipe

One JSON line per row on stdout; --markdown adds the table. See
docs/benchmarks.md ("Serving").
"""

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)
from bench import harness  # pylint: disable=g-import-not-at-top,g-bad-import-order


def ParseArgs(argv):
  parser = harness.Parser(__doc__, markdown_help='Print a markdown table too.')
  parser.add_argument('--model', default='lm.TransformerLmTinyGPipe',
                      help='A registered experiment.')
  parser.add_argument('--batches', default='1,32',
                      help='Comma-separated batch sizes.')
  parser.add_argument('--devices', type=int, default=2,
                      help='CPU devices of the training graph.')
  parser.add_argument('--runs', type=int, default=50,
                      help='Timed calls per row.')
  parser.add_argument('--warmup', type=int, default=5,
                      help='Untimed calls first.')
  args = parser.parse_args(argv)
  try:
    args.batches = [int(b) for b in args.batches.split(',') if b]
  except ValueError:
    parser.error(f'--batches={args.batches!r}: give integers, e.g. 1,32')
  if not args.batches or min(args.batches) < 1:
    parser.error('--batches: give sizes >= 1, e.g. 1,32')
  if args.runs < 1 or args.warmup < 0 or args.devices < 1:
    parser.error('--runs must be >= 1, --warmup >= 0 and --devices >= 1')
  return args


def _Median(fn, runs, warmup):
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1000.0


def _Batch(cfg, batch, rng):
  """{input name: array} of one random batch for the task's `default`."""
  inp = cfg.input
  if 'seq_len' in inp:
    ids = rng.randint(2, cfg.task.vocab_size, [batch, inp.seq_len])
    return {'ids': ids.astype(np.int32), 'labels': ids.astype(np.int32),
            'weights': np.ones([batch, inp.seq_len], np.float32)}
  return {'images': rng.randn(batch, *inp.data_shape).astype(np.float32)}


def _TrainingForward(model, devices, batches, ckpt_dir, runs, warmup):
  """{batch: (batch run, ms)} of the training graph's forward pass, and its
  pipeline op count; saves its (random) weights as a checkpoint."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  from lingvo_ext.serving import saved_model  # pylint: disable=g-import-not-at-top
  cfg = experiment_params.GetParams(model, 'Train')
  m = cfg.task.num_micro_batches
  rng = np.random.RandomState(0)
  g = tf.Graph()
  with g.as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=devices, split_size=devices):
    task = cfg.Instantiate().GetTask()
    fetches = {}
    for b in batches:
      run = -(-b // m) * m  # The pipeline splits it into m micro-batches.
      feed = _Batch(cfg, run, rng)
      key = 'ids' if 'ids' in feed else 'data'
      value = feed['ids'] if key == 'ids' else feed['images']
      logits = task.ComputePredictions(
          task.theta, py_utils.NestedMap({key: tf.constant(value)})).logits
      fetches[b] = (run, logits)
    init = tf.global_variables_initializer()
    saver = tf.train.Saver()
  ops = saved_model.CountOps(g.as_graph_def(), saved_model.PIPELINE_OP_TYPES)
  config = tf.config_pb2.ConfigProto(device_count={'CPU': devices})
  out = {}
  with tf.Session(graph=g, config=config) as sess:
    sess.run(init)
    ckpt = saver.save(sess, os.path.join(ckpt_dir, 'ckpt-00000000'))
    for b, (run, logits) in fetches.items():
      out[b] = (run, _Median(lambda t=logits: sess.run(t), runs, warmup))
  return out, ops, ckpt, cfg


def main(argv=None):
  args = ParseArgs(sys.argv[1:] if argv is None else argv)
  import lingvo_ext  # pylint: disable=unused-import,g-import-not-at-top
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  import tensorflow as tf2  # pylint: disable=g-import-not-at-top
  from lingvo_ext.serving import export  # pylint: disable=g-import-not-at-top
  from lingvo_ext.serving import saved_model  # pylint: disable=g-import-not-at-top
  tf.flags.FLAGS([sys.argv[0]])
  work = tempfile.mkdtemp(prefix='bench_serving_')
  train, train_ops, ckpt, cfg = _TrainingForward(
      args.model, args.devices, args.batches, work, args.runs, args.warmup)
  export_dir = os.path.join(work, 'export')
  export.Export(args.model, export_dir, checkpoint=ckpt,
                subgraphs=['default'])
  # The graph the SavedModel freezes (its signatures are function calls of
  # it): Lingvo's inference graph written beside it.
  from lingvo.core import predictor  # pylint: disable=g-import-not-at-top
  graph = predictor.LoadInferenceGraph(
      os.path.join(export_dir, export.INFERENCE_GRAPH))
  exported_ops = saved_model.CountOps(graph.graph_def,
                                      saved_model.PIPELINE_OP_TYPES)
  serve = tf2.saved_model.load(export_dir).signatures['default']
  rng = np.random.RandomState(0)
  rows = []
  for b in args.batches:
    feed = {k: tf2.constant(v) for k, v in _Batch(cfg, b, rng).items()}
    ms = _Median(lambda f=feed: serve(**f), args.runs, args.warmup)
    run, train_ms = train[b]
    rows.append({
        'model': args.model, 'batch': b, 'saved_model_ms': round(ms, 3),
        'saved_model_examples_per_s': round(b / ms * 1000.0, 1),
        'training_forward_batch': run,
        'training_forward_ms': round(train_ms, 3),
        'training_forward_examples_per_s': round(run / train_ms * 1000.0, 1),
        'training_devices': args.devices,
        'training_pipeline_ops': train_ops,
        'exported_pipeline_ops': exported_ops,
    })
  for r in rows:
    print(json.dumps(r), flush=True)
  if args.markdown:
    print('\n' + harness.Table(
        ('batch', 'SavedModel ms', 'SavedModel examples/s',
         'training forward (batch) ms', 'training forward examples/s'),
        [(r['batch'], f"{r['saved_model_ms']:.2f}",
          f"{r['saved_model_examples_per_s']:.0f}",
          f"({r['training_forward_batch']}) {r['training_forward_ms']:.2f}",
          f"{r['training_forward_examples_per_s']:.0f}") for r in rows]))
    print(f'\npipeline ops: training graph {train_ops}, exported graph '
          f'{exported_ops}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
