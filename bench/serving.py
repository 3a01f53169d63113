"""The SavedModel's latency against the training graph's, and generation.

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

For an LM, generation too: the `generate` signature of three exports of
the same checkpoint, 'cached' (task.decode_cache=True: keys and values
kept, one position per new token, the loop XLA-compiled), 'cached_ops'
(the same without XLA, task.decode_jit_compile=False) and 'rerun'
(task.decode_cache=False: the whole window per new token), greedy from a
--prefix_len prefix to each of --max_lens at each of --gen_batches, timed
in turn with the `default` signature scoring one window (seq_len tokens)
at the same batch. A row gives each variant's median ms, new tokens/s and
its time over the window's, in wall and in the process's CPU time (which
other processes' load moves less), and whether all gave the same ids. The models get task.max_seq_len=--max_seq_len (0: seq_len), the
rows of the position embedding and so the longest max_len; the re-run's
window is that long.

  .venv/bin/python bench/serving.py --markdown
  .venv/bin/python bench/serving.py --max_seq_len=0 --max_lens=16,32
  .venv/bin/python bench/serving.py --model=image.ConvClassifierTinyGPipe

One JSON line per row on stdout; --markdown adds the table. See
docs/benchmarks.md ("Serving").
"""

import json
import os
import shutil
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
  parser.add_argument('--gen_batches', default='1,16',
                      help='LM: batch sizes of the generation rows; empty: '
                      'none.')
  parser.add_argument('--max_lens', default='16,32,64',
                      help='LM: the generation rows\' max_len values.')
  parser.add_argument('--prefix_len', type=int, default=4,
                      help='LM: tokens of the prompt each generation starts '
                      'from.')
  parser.add_argument('--max_seq_len', type=int, default=64,
                      help='LM: task.max_seq_len of the models (0: seq_len).')
  args = parser.parse_args(argv)
  for name, example in (('batches', '1,32'), ('gen_batches', '1,16'),
                        ('max_lens', '16,32,64')):
    text = getattr(args, name)
    try:
      values = [int(b) for b in text.split(',') if b]
    except ValueError:
      parser.error(f'--{name}={text!r}: give integers, e.g. {example}')
    if min(values, default=1) < 1 or (name == 'batches' and not values):
      parser.error(f'--{name}: give sizes >= 1, e.g. {example}')
    setattr(args, name, values)
  if args.runs < 1 or args.warmup < 0 or args.devices < 1:
    parser.error('--runs must be >= 1, --warmup >= 0 and --devices >= 1')
  if args.prefix_len < 1 or args.max_seq_len < 0:
    parser.error('--prefix_len must be >= 1 and --max_seq_len >= 0')
  if args.max_lens and min(args.max_lens) <= args.prefix_len:
    parser.error(f'--max_lens: each must exceed --prefix_len='
                 f'{args.prefix_len}')
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


def _TrainingForward(model, devices, batches, ckpt_dir, runs, warmup,
                     overrides=''):
  """{batch: (batch run, ms)} of the training graph's forward pass, and its
  pipeline op count; saves its (random) weights as a checkpoint."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from lingvo_ext.serving import saved_model  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  cfg = experiment_params.GetParams(model, 'Train', overrides)
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


# generate's variants: (name, task.decode_cache, task.decode_jit_compile).
_VARIANTS = (('cached', True, True), ('cached_ops', True, False),
             ('rerun', False, False))
_LABELS = (('cached', 'cached'), ('cached_ops', 'cached, no XLA'),
           ('rerun', 're-run'))


def _RoundRobinCpu(steps, rounds):
  """([wall ms], [CPU ms]): each step's medians, the steps taken in turn.

  The process's CPU time (every thread's) moves less with the load of
  other processes than the wall time does.
  """
  wall = [[] for _ in steps]
  cpu = [[] for _ in steps]
  for _ in range(rounds):
    for i, step in enumerate(steps):
      start, start_cpu = time.perf_counter(), time.process_time()
      step()
      wall[i].append(time.perf_counter() - start)
      cpu[i].append(time.process_time() - start_cpu)
  if not rounds:
    return [], []
  return ([statistics.median(t) * 1000.0 for t in wall],
          [statistics.median(t) * 1000.0 for t in cpu])


def _Generation(args, cfg, ckpt, work, overrides):
  """The generation rows: cached against re-run (see the docstring)."""
  import tensorflow as tf2  # pylint: disable=g-import-not-at-top

  from lingvo_ext.serving import export  # pylint: disable=g-import-not-at-top
  signatures = {}
  for name, cache, jit in _VARIANTS:
    export_dir = os.path.join(work, f'generate_{name}')
    export.Export(args.model, export_dir, checkpoint=ckpt,
                  subgraphs=['default', 'generate'],
                  overrides=f'{overrides};task.decode_cache:{cache};'
                  f'task.decode_jit_compile:{jit}')
    signatures[name] = tf2.saved_model.load(export_dir).signatures
  score = signatures['cached']['default']
  rng = np.random.RandomState(1)
  rows = []
  for b in args.gen_batches:
    prefix = tf2.constant(rng.randint(
        2, cfg.task.vocab_size, [b, args.prefix_len]).astype(np.int32))
    window = {k: tf2.constant(v) for k, v in _Batch(cfg, b, rng).items()}
    for max_len in args.max_lens:
      feed = dict(prefix=prefix, max_len=tf2.constant(max_len),
                  temperature=tf2.constant(0.0), top_k=tf2.constant(0),
                  seed=tf2.constant(1))
      names = [n for n, _, _ in _VARIANTS]
      gens = [lambda s=signatures[n]['generate']: s(**feed)['ids'].numpy()
              for n in names]
      steps = [lambda: score(**window)['log_probs'].numpy()] + gens
      ids = [g() for g in gens]  # The first call compiles the XLA loop.
      _RoundRobinCpu(steps, args.warmup)
      wall, cpu = _RoundRobinCpu(steps, args.runs)
      (score_ms, *gen_ms), (score_cpu, *gen_cpu) = wall, cpu
      new = b * (max_len - args.prefix_len)
      row = {
          'model': args.model, 'kind': 'generate', 'batch': b,
          'max_len': max_len, 'prefix_len': args.prefix_len,
          'max_seq_len': args.max_seq_len, 'new_tokens': new,
          'score_window_ms': round(score_ms, 3),
          'score_window_cpu_ms': round(score_cpu, 3),
          'same_ids': all(np.array_equal(i, ids[0]) for i in ids),
          'ids_shape': list(ids[0].shape),
      }
      for name, ms, cpu_ms in zip(names, gen_ms, gen_cpu):
        row.update({
            f'{name}_ms': round(ms, 3),
            f'{name}_cpu_ms': round(cpu_ms, 3),
            f'{name}_tokens_per_s': round(new / ms * 1000.0, 1),
            f'{name}_over_window': round(ms / score_ms, 2),
            f'{name}_over_window_cpu': round(cpu_ms / score_cpu, 2)})
      rows.append(row)
  return rows


def _GenerationTable(rows):
  header = ['batch', 'max_len', 'new tokens', 'one window ms']
  for _, label in _LABELS:
    header += [f'{label} ms', f'{label} tokens/s',
               f'{label} / one window (CPU)']
  header.append('same ids')
  lines = []
  for r in rows:
    line = [r['batch'], r['max_len'], r['new_tokens'],
            f"{r['score_window_ms']:.2f}"]
    for name, _ in _LABELS:
      line += [f"{r[name + '_ms']:.2f}", f"{r[name + '_tokens_per_s']:.0f}",
               f"{r[name + '_over_window']:.2f} "
               f"({r[name + '_over_window_cpu']:.2f})"]
    lines.append(line + [r['same_ids']])
  return harness.Table(header, lines)


def main(argv=None):
  args = ParseArgs(sys.argv[1:] if argv is None else argv)
  from lingvo_ext import entry_point  # pylint: disable=unused-import,g-import-not-at-top
  # isort: split
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  tf.flags.FLAGS([sys.argv[0]])
  inp = experiment_params.GetParams(args.model, 'Train').input
  lm = bool('seq_len' in inp and args.gen_batches and args.max_lens)
  overrides = f'task.max_seq_len:{args.max_seq_len}' if lm else ''
  if lm and max(args.max_lens) > (args.max_seq_len or inp.seq_len):
    print(f'error: --max_lens={max(args.max_lens)} exceeds the models\' '
          f'position embedding ({args.max_seq_len or inp.seq_len} rows); '
          'raise --max_seq_len.', file=sys.stderr)
    return 2
  work = tempfile.mkdtemp(prefix='bench_serving_')
  try:
    return _Bench(args, inp, overrides if lm else None, work)
  finally:
    shutil.rmtree(work, ignore_errors=True)


def _Bench(args, inp, overrides, work):
  """The rows, printed; `overrides` None: no generation rows."""
  import tensorflow as tf2  # pylint: disable=g-import-not-at-top

  from lingvo_ext.serving import export  # pylint: disable=g-import-not-at-top
  from lingvo_ext.serving import saved_model  # pylint: disable=g-import-not-at-top
  lm = overrides is not None
  overrides = overrides or ''
  train, train_ops, ckpt, cfg = _TrainingForward(
      args.model, args.devices, args.batches, work, args.runs, args.warmup,
      overrides)
  export_dir = os.path.join(work, 'export')
  export.Export(args.model, export_dir, checkpoint=ckpt,
                subgraphs=['default'], overrides=overrides)
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
        'model': args.model, 'kind': 'score', 'batch': b,
        'saved_model_ms': round(ms, 3),
        'saved_model_examples_per_s': round(b / ms * 1000.0, 1),
        'training_forward_batch': run,
        'training_forward_ms': round(train_ms, 3),
        'training_forward_examples_per_s': round(run / train_ms * 1000.0, 1),
        'training_devices': args.devices,
        'training_pipeline_ops': train_ops,
        'exported_pipeline_ops': exported_ops,
    })
  gen_rows = _Generation(args, cfg, ckpt, work, overrides) if lm else []
  for r in rows + gen_rows:
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
    if gen_rows:
      print(f'\ngenerate, greedy from {args.prefix_len} tokens '
            f'(task.max_seq_len={args.max_seq_len}); one window: the '
            f'default signature over {inp.seq_len} tokens:\n')
      print(_GenerationTable(gen_rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
