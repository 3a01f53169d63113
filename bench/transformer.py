"""Lingvo's GPipeTransformerStack: lingvo.core.gpipe vs lingvo_ext, per schedule.

Builds the same stack (`layers_with_gpipe.GPipeTransformerStack`, encoder
only: model_dim 64, hidden 128, 2 heads, 16 time steps, batch 32, a 32-word
vocabulary and softmax) with Lingvo's module and with lingvo_ext's, same
Params and seed, and reports per configuration the graph's op count, the time
to the first step (graph building plus the first Session.run: placement and
Grappler), the median step time (forward, tf.gradients, SGD) and the peak
RSS. Each configuration runs in a fresh child process, on `K` logical CPU
devices with 2 inter-op threads and `--intra_op_threads` intra-op threads (1
by default; 0 is TensorFlow's default, one per core, which the trainer's
session uses; the pool is one for all devices). The pools are set before
the graph is built: a tf.function (lingvo_ext's cell functions, and Lingvo's
loop) starts TensorFlow's eager context, whose pools every later session
shares whatever its config says.

  .venv/bin/python bench/transformer.py --L 8 --K 2 --M 4
  .venv/bin/python bench/transformer.py --L 8 32 --K 2 4 --M 4 16 --markdown
      # (K, M) = (2, 4) and (4, 16), each at L = 8 and 32
  .venv/bin/python bench/pipeline.py --models transformer   # the same sweep
  .venv/bin/python bench/transformer.py --K 2 --M 4 --variants unrolled 1f1b \
      --dtype float32,bfloat16 --markdown   # bf16 beside float32
  .venv/bin/python bench/transformer.py --L 32 --K 4 --M 16 \
      --variants lingvo unrolled --intra_op_threads 0 --markdown
      # the trainer's thread pools

`--loss after` (the default) is Lingvo's, after the pipeline ('1f1b' then
recomputes); `--loss last_cell` computes the per-example cross-entropy in
the last cell (`loss_in_last_cell=True`), as torch's pipelining does;
`--loss after last_cell` runs both. Sizes: `--d_model`, `--hidden`,
`--seq`, `--batch`, `--heads`; the size ladder is docs/benchmarks.md's.

Each (sizes, dtype) also gets a 'floor' row (`--no-floor`: none): the GEMM
floor (bench/gemm_floor.py), the step's matmul FLOPs counted from its graph
(cells inline) at the pace this process measures for each of the step's
matmul shapes, on the same thread pools; `--markdown` prints every column
as a multiple of it first. torch eager also runs in bf16 autocast when
--dtype has bfloat16 (`--bf16_autocast`).

Variants: 'lingvo' (lingvo.core.gpipe), and lingvo_ext '<schedule>' with
optional '+inline' (`cell_functions=False`: each (cell, micro-batch) its own
copy of the cell's ops; the default, '+functions', builds each cell once as a
TF function called per micro-batch), '+jit' (`jit_compile=True`), '+auto'
(`jit_compile='auto'`, what --jit_compile=auto sets for a long run: the faster,
timed in the child's build, the record's `jit_taken` says which) and '+bmm'
(`flat_weight_matmuls=False`: TensorFlow's broadcasting BatchMatMul for a
3-D activation times a weight, as before the rewrite) and '+cellchecks'
(`check_numerics='cells'`: Lingvo's NaN/Inf checks in every cell per
micro-batch, not once a step). With a torch venv
(`bash scripts/torch_venv.sh`, or `--torch_python PATH`), torch's rows at the
same sizes follow each configuration's (bench/torch_baselines.py).
"""

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)
from bench import transformer_report  # pylint: disable=g-import-not-at-top,g-bad-import-order

DEFAULT_VARIANTS = ('lingvo', 'unrolled', 'unrolled+inline', '1f1b',
                    '1f1b+inline', 'recurrent')
T, B, D, HIDDEN, HEADS, VOCAB = transformer_report.SIZES
# The sizes (flags of the same names): the small default.
DIMS = dict(d_model=D, hidden=HIDDEN, seq=T, batch=B, heads=HEADS)


def StepMatmulFlops(num_layers: int, d_model: int, hidden: int, seq: int,
                    batch: int, vocab: int = VOCAB) -> int:
  """The training step's matmul FLOPs by formula (bench/gemm_floor.py counts
  them from the graph): per encoder layer the query, key and output
  projections (3 d^2 per token: Lingvo's attention has no value projection,
  `enable_ctx_pre_proj=False`; torch's has one), the feed-forward (2 d hidden
  per token) and attention's logits and context (2 seq d per token, all
  heads); the softmax's d vocab per token; 2 FLOPs a multiply-add; backward
  twice the forward (each matmul has two operand gradients; the embedding is
  a gather)."""
  tokens = seq * batch
  per_layer = 3 * d_model**2 + 2 * d_model * hidden + 2 * seq * d_model
  forward = 2 * tokens * (num_layers * per_layer + d_model * vocab)
  return 3 * forward


def _Build(variant: str, num_layers: int, k: int, m: int, dtype: str,
           loss_placement: str, dims: dict):
  """The stack's training step in a new graph: (graph, loss, train, init)."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import layers_with_gpipe as lingvo_stacks  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lingvo_ext.core import layers_with_gpipe as ext_stacks  # pylint: disable=g-import-not-at-top
  d, seq, batch = dims['d_model'], dims['seq'], dims['batch']
  schedule, *extras = variant.split('+')
  stacks = lingvo_stacks if schedule == 'lingvo' else ext_stacks
  g = tf.Graph()
  with g.as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=k, split_size=k):
    tf.random.set_seed(1)
    global_step = py_utils.GetOrCreateGlobalStepVar()
    p = stacks.GPipeTransformerStack.Params().Set(
        name='transformer', model_dim=d, num_encoder_layers=num_layers,
        num_decoder_layers=0, splits=k, num_micro_batches=m,
        state_dtype=tf.float32, random_seed=0)
    if dtype == 'bfloat16':
      p.fprop_dtype = p.state_dtype = tf.bfloat16
    p.encoder_tpl.source_dim = d
    p.encoder_tpl.tr_atten_tpl.num_attention_heads = dims['heads']
    p.encoder_tpl.tr_fflayer_tpl.hidden_dim = dims['hidden']
    p.emb_tpl.token_emb.Set(embedding_dim=d, vocab_size=VOCAB)
    p.emb_tpl.position_emb.embedding_dim = d
    p.softmax_tpl.Set(input_dim=d, num_classes=VOCAB)
    if schedule != 'lingvo':
      p.schedule = schedule
      p.cell_functions = 'inline' not in extras
      # '+auto': what --jit_compile=auto sets for a long run (the faster).
      p.jit_compile = 'auto' if 'auto' in extras else 'jit' in extras
      p.flat_weight_matmuls = 'bmm' not in extras
      p.check_numerics = 'cells' if 'cellchecks' in extras else 'step'
      p.loss_in_last_cell = loss_placement == 'last_cell'
    if schedule != 'lingvo' and 'auto' in extras:
      # Resolved before the build, as the trainer resolves it.
      from lingvo_ext.runtime import jit_resolve  # pylint: disable=g-import-not-at-top
      shape = [seq, batch]
      jit_resolve.ResolveLayer(p, lambda net: net.FPropDefaultTheta(
          tf.zeros(shape, tf.int32), tf.zeros(shape),
          labels=tf.zeros(shape, tf.int32), label_weights=tf.ones(shape)), k)
    net = p.Instantiate()
    rng = np.random.RandomState(0)
    ids = tf.constant(rng.randint(0, VOCAB, [seq, batch]), tf.int32)
    labels = tf.constant(rng.randint(0, VOCAB, [seq, batch]), tf.int32)
    xent, _ = net.FPropDefaultTheta(ids, tf.zeros([seq, batch]),
                                    labels=labels,
                                    label_weights=tf.ones([seq, batch]))
    loss = tf.reduce_sum(tf.cast(xent, tf.float32))
    variables = net.vars.Flatten()
    grads = tf.gradients(loss, variables, colocate_gradients_with_ops=True)
    # The loss is summed over tokens: a step size that shrinks with the
    # width keeps wide stacks from diverging to NaN within a run's steps.
    lr = 1e-4 * D / d
    train = tf.group(
        [tf.assign_sub(v, lr * tf.convert_to_tensor(dv))
         for v, dv in zip(variables, grads)] + [tf.assign_add(global_step, 1)])
    init = tf.global_variables_initializer()
  # The build taken: 'auto' resolved before the build.
  g.jit_taken = schedule != 'lingvo' and net.JitCompile()
  return g, loss, train, init


def _SetPools(intra_op_threads: int) -> None:
  """lingvo_ext's cell functions are tf.functions: defining one starts
  TensorFlow's eager context, whose thread pools (made first, with
  TensorFlow's defaults) the session then uses, whatever its config says.
  Set them first so every variant runs on the same pools."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  if intra_op_threads:
    tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)


def _SessionConfig(k: int, intra_op_threads: int):
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  return tf.config_pb2.ConfigProto(
      device_count={'CPU': k}, inter_op_parallelism_threads=2,
      intra_op_parallelism_threads=intra_op_threads)


def _FloorChild(num_layers: int, k: int, m: int, dtype: str,
                intra_op_threads: int, dims: dict) -> dict:
  """The GEMM floor of the default build's step (its matmuls, counted from
  the graph with cells inline: the same matmuls), timed in this process on
  the variants' thread pools."""
  sys.path.insert(0, _REPO)
  from lingvo_ext import entry_point  # pylint: disable=g-import-not-at-top,unused-import
  # isort: split
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from bench import gemm_floor  # pylint: disable=g-import-not-at-top
  py_utils.SetEagerMode(False)
  _SetPools(intra_op_threads)
  _, _, train, _ = _Build('unrolled+inline', num_layers, k, m, dtype, 'after',
                          dims)
  shapes = gemm_floor.MatmulShapes([train])
  floor = gemm_floor.Floor(shapes, _SessionConfig(k, intra_op_threads))
  return dict(variant=transformer_report.FLOOR, dtype=dtype, L=num_layers, K=k, M=m,
              loss='after', **dims, step_ms=floor['floor_ms'],
              formula_gflop=round(StepMatmulFlops(
                  num_layers, dims['d_model'], dims['hidden'], dims['seq'],
                  dims['batch']) / 1e9, 4), **floor)


def _Child(variant: str, num_layers: int, k: int, m: int, steps: int,
           dtype: str = 'float32', intra_op_threads: int = 1,
           loss_placement: str = 'after', dims: dict = None) -> dict:
  """Builds and times one configuration in this process.

  `dtype` 'bfloat16': the stack's fprop_dtype (Lingvo's mixed precision:
  float32 variables and updates, bfloat16 cells and states between them).
  `loss_placement` 'last_cell': lingvo_ext's loss_in_last_cell (not for 'lingvo').
  `dims`: DIMS's keys.
  """
  dims = dict(DIMS, **(dims or {}))
  if variant == transformer_report.FLOOR:
    return _FloorChild(num_layers, k, m, dtype, intra_op_threads, dims)
  t0 = time.time()
  sys.path.insert(0, _REPO)
  from lingvo_ext import entry_point  # pylint: disable=g-import-not-at-top,unused-import
  # isort: split
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lingvo_ext.core import precision  # pylint: disable=g-import-not-at-top
  py_utils.SetEagerMode(False)
  _SetPools(intra_op_threads)
  t_import = time.time() - t0
  t0 = time.time()
  g, loss, train, init = _Build(variant, num_layers, k, m, dtype,
                                loss_placement, dims)
  ops = len(g.get_operations())
  cross_bytes, _ = precision.CrossDeviceBytes(g)
  t_build = time.time() - t0
  config = _SessionConfig(k, intra_op_threads)
  with tf.Session(graph=g, config=config) as sess:
    sess.run(init)
    loss0, _ = sess.run([loss, train])
    t_first = time.time() - t0
    times, cpu_times = [], []
    for _ in range(steps):
      t1, c1 = time.time(), time.process_time()
      sess.run(train)
      times.append(time.time() - t1)
      cpu_times.append(time.process_time() - c1)
    # Before the traced step: its trace (a record per op run, tens of
    # thousands inside cell functions) is the benchmark's, not training's.
    peak_rss_mb = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    md = tf.RunMetadata()  # One traced step: where the time goes.
    sess.run(train, options=tf.RunOptions(
        trace_level=tf.RunOptions.FULL_TRACE), run_metadata=md)
  from lingvo_ext.tracing import step_trace  # pylint: disable=g-import-not-at-top
  ms_by_op = OpTimes(md.step_stats)
  calls_ms = sum(v for o, v in ms_by_op.items() if o in step_trace.CALL_OPS)
  from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  return dict(
      variant=variant, dtype=dtype, L=num_layers, K=k, M=m, ops=ops, **dims,
      jit_taken=bool(g.jit_taken),
      loss='after' if variant == 'lingvo' else loss_placement,
      # Call ops in the graph: with recompute, a backward pass calls each
      # cell's forward function again.
      call_ops=sum(1 for o in g.get_operations()
                   if o.type in ('PartitionedCall', 'StatefulPartitionedCall')),
      # The pools the session ran on (0: TensorFlow's default).
      intra_op_threads=tf.config.threading.get_intra_op_parallelism_threads(),
      bytes_between_cells=cross_bytes,
      import_s=round(t_import, 2), build_s=round(t_build, 2),
      first_step_s=round(t_first, 2),
      step_ms=round(1e3 * float(np.median(times)), 1),
      # The process's CPU time (every thread) a step, median as step_ms
      # (the first timed step's differs: a fetch of its own, so the session
      # prepares another executor). About the cores times step_ms: the step
      # is bound by the work it does, not by waiting.
      cpu_ms=round(1e3 * float(np.median(cpu_times)), 1),
      peak_rss_mb=peak_rss_mb,
      loss0=float(loss0), onednn=bool(_pywrap_util_port.IsMklEnabled()),
      cpu_bf16_units=precision.CpuHasBf16Units(),
      busy_ms=round(sum(ms_by_op.values()), 1),
      # Op time without the call ops' spans (their body ops count anyway),
      # and how many ops ran in the traced step (calls excluded).
      op_ms=round(sum(ms_by_op.values()) - calls_ms, 1),
      ops_run=OpsRun(md.step_stats),
      matmul_ms=round(
          sum(v for o, v in ms_by_op.items() if 'MatMul' in o), 1),
      cast_ms=round(ms_by_op.get('Cast', 0.0), 1),
      # Lingvo's NaN/Inf checks (check_numerics: once a step or per cell).
      check_ms=round(ms_by_op.get('CheckNumerics', 0.0), 1),
      top_ops_ms={o: round(v, 1) for o, v in sorted(
          ms_by_op.items(), key=lambda x: -x[1])[:10]})


def _OpTypes(step_stats):
  """(op type, ms) of each op a traced step ran, on every device."""
  from lingvo_ext.tracing import step_trace  # pylint: disable=g-import-not-at-top
  for dev in step_stats.dev_stats:
    for node in dev.node_stats:
      op = step_trace.OpType(node.timeline_label)
      if op:
        yield op, node.all_end_rel_micros / 1e3


def OpsRun(step_stats) -> int:
  """How many ops a traced step ran on every device, call ops excluded."""
  from lingvo_ext.tracing import step_trace  # pylint: disable=g-import-not-at-top
  return sum(1 for op, _ in _OpTypes(step_stats)
             if op not in step_trace.CALL_OPS)


def OpTimes(step_stats) -> dict:
  """{op type: ms} summed over a traced step's ops on every device.

  A function call's time (cell_functions) spans the ops it runs, which the
  trace also records under their own types: those count twice in the sum.
  """
  out = {}
  for op, ms in _OpTypes(step_stats):
    out[op] = out.get(op, 0.0) + ms
  return out


def Pairs(ks, ms):
  """(K, M) pairs: zipped when as many K as M are given, else all pairs."""
  if len(ks) == len(ms):
    return list(zip(ks, ms))
  return list(itertools.product(ks, ms))


def Run(variants, num_layers, km_pairs, steps, timeout_s=1800,
        dtypes=('float32',), runner=subprocess.run, intra_op_threads=1,
        losses=('after',), dims_list=(DIMS,)):
  """Each configuration in a fresh child; returns the records.

  `runner`: subprocess.run, or a stand-in with its signature (the tests
  fork the children from a pre-imported server, tests/support/zygote.py).
  `dims_list`: the sizes (DIMS's keys) to run each configuration at. Variant
  transformer_report.FLOOR: the GEMM floor (bench/gemm_floor.py), once per sizes and dtype.
  """
  records = []
  for dims, l, (k, m), loss, v, dtype in itertools.product(
      dims_list, num_layers, km_pairs, losses, variants, dtypes):
    if v in ('lingvo', transformer_report.FLOOR) and loss != losses[0]:
      continue  # Lingvo's stack has the loss after its pipeline only.
    dims = dict(DIMS, **dims)
    cmd = [sys.executable, os.path.abspath(__file__), '--_child', v,
           '--L', str(l), '--K', str(k), '--M', str(m), '--steps',
           str(steps), '--dtype', dtype, '--intra_op_threads',
           str(intra_op_threads), '--loss', loss]
    for name, value in dims.items():
      cmd += ['--' + name, str(value)]
    print('[bench] %s %s L=%d K=%d M=%d loss %s d_model %d' %
          (v, dtype, l, k, m, loss, dims['d_model']),
          file=sys.stderr, flush=True)
    try:
      res = runner(cmd, capture_output=True, text=True, timeout=timeout_s,
                   check=False)
    except subprocess.TimeoutExpired:
      records.append(dict(variant=v, dtype=dtype, L=l, K=k, M=m, loss=loss,
                          error='timeout %ds' % timeout_s, **dims))
      continue
    lines = [x for x in res.stdout.splitlines() if x.startswith('{')]
    if res.returncode or not lines:
      tail = res.stderr.strip().splitlines()[-1:] or ['no output']
      records.append(dict(variant=v, dtype=dtype, L=l, K=k, M=m, loss=loss,
                          error='exit %d: %s' % (res.returncode, tail[0]),
                          **dims))
      continue
    records.append(json.loads(lines[-1]))
  return records


LOSSES = ('after', 'last_cell')


def ParseDtypes(text):
  """'float32,bfloat16' -> ['float32', 'bfloat16']; argparse's type."""
  dtypes = [d.strip() for d in text.split(',') if d.strip()]
  if not dtypes or any(d not in transformer_report.DTYPES for d in dtypes):
    raise argparse.ArgumentTypeError(
        '%r: give float32, bfloat16 or float32,bfloat16' % text)
  return dtypes


def main(argv=None) -> int:
  sys.path.insert(0, _REPO)
  from bench import harness  # pylint: disable=g-import-not-at-top
  parser = harness.Parser(__doc__)
  parser.add_argument('--L', type=int, nargs='+', default=[8],
                      help='Encoder layers.')
  parser.add_argument('--K', type=int, nargs='+', default=[2],
                      help='Cells (splits), one device each; paired with '
                      '--M in order when as many are given, else every pair.')
  parser.add_argument('--M', type=int, nargs='+', default=[4],
                      help='Micro-batches.')
  parser.add_argument('--variants', nargs='+', default=list(DEFAULT_VARIANTS),
                      help="'lingvo' or '<schedule>[+inline][+jit|+auto]'.")
  parser.add_argument('--steps', type=int, default=5,
                      help='Timed steps after the first.')
  parser.add_argument('--torch_python', metavar='PATH',
                      help='A python with torch: also time '
                      'bench/torch_baselines.py --model transformer (torch '
                      'eager, GPipe, 1F1B). Default: .venv-torch/bin/python '
                      'when it exists; "none" turns it off.')
  parser.add_argument(
      '--dtype', default='float32', type=ParseDtypes,
      help="'float32' (default), 'bfloat16' (fprop_dtype: float32 variables, "
      "bfloat16 cells) or both, 'float32,bfloat16', side by side.")
  parser.add_argument(
      '--intra_op_threads', type=int, default=1,
      help='Intra-op threads of the session (one pool for all devices); 0: '
      "TensorFlow's default, one per core, as the trainer's session.")
  parser.add_argument(
      '--loss', nargs='+', choices=LOSSES, default=['after'],
      help="Where lingvo_ext's stack computes the cross-entropy: 'after' the "
      "pipeline (Lingvo's) or in the 'last_cell' (no '1f1b' recompute); "
      'both: side by side. See the module docstring.')
  parser.add_argument('--d_model', type=int, nargs='+', default=[D],
                      help='Model widths, each a configuration (the ladder: '
                      '64 512 1024).')
  parser.add_argument('--hidden', type=int, nargs='+',
                      help='Feed-forward widths, one per --d_model (default '
                      '2x each).')
  parser.add_argument('--seq', type=int, default=T, help='Time steps.')
  parser.add_argument('--batch', type=int, default=B, help='Batch size.')
  parser.add_argument('--heads', type=int, default=HEADS,
                      help='Attention heads.')
  parser.add_argument('--floor', action=argparse.BooleanOptionalAction,
                      default=True,
                      help='Also time the GEMM floor (bench/gemm_floor.py) '
                      'per sizes and dtype.')
  parser.add_argument('--bf16_autocast', action=argparse.BooleanOptionalAction,
                      default=None,
                      help='Torch eager also in bf16 autocast (default: '
                      'when --dtype has bfloat16).')
  parser.add_argument('--rounds', type=int, default=1,
                      help='Time every configuration this many times in '
                      'turn; each keeps its fastest round (a shared machine).')
  parser.add_argument('--_child', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.intra_op_threads < 0:
    parser.error('--intra_op_threads=%d: give 0 (one per core) or more.' %
                 args.intra_op_threads)
  for name in ('seq', 'batch', 'heads', 'steps', 'rounds'):
    if getattr(args, name) < 1:
      parser.error('--%s=%d: give 1 or more.' % (name, getattr(args, name)))
  if args.hidden is None:
    args.hidden = [2 * d for d in args.d_model]
  if len(args.hidden) != len(args.d_model):
    parser.error('--hidden: %d values for %d --d_model values; give one per '
                 'width.' % (len(args.hidden), len(args.d_model)))
  for d, h in zip(args.d_model, args.hidden):
    if d < 1 or h < 1 or d % args.heads:
      parser.error('--d_model %d, --hidden %d: give widths >= 1, d_model '
                   'divisible by --heads %d.' % (d, h, args.heads))
  for m in args.M:
    if m < 1 or args.batch % m:
      parser.error('--M %d does not divide --batch %d; give M that divide '
                   'it.' % (m, args.batch))
  dims_list = [dict(d_model=d, hidden=h, seq=args.seq, batch=args.batch,
                    heads=args.heads)
               for d, h in zip(args.d_model, args.hidden)]
  sys.path.insert(0, _REPO)
  from bench import torch_common  # pylint: disable=g-import-not-at-top
  if torch_common.BadTorchPython(args.torch_python):
    parser.error(torch_common.BadTorchPython(args.torch_python))
  for v in ([args._child] if args._child else args.variants):  # pylint: disable=protected-access
    schedule, *extras = v.split('+')
    if v == transformer_report.FLOOR:
      continue
    if (schedule not in ('lingvo', 'unrolled', '1f1b', 'recurrent') or
        not set(extras) <= {'functions', 'inline', 'jit', 'auto', 'bmm',
                            'cellchecks'}):
      parser.error("--variants: %r is not 'lingvo' or "
                   "'<unrolled|1f1b|recurrent>[+inline|+functions]"
                   "[+jit|+auto][+bmm][+cellchecks]'" % v)
  if args._child:  # pylint: disable=protected-access
    print(json.dumps(_Child(args._child, args.L[0], args.K[0], args.M[0],  # pylint: disable=protected-access
                            args.steps, args.dtype[0],
                            args.intra_op_threads, args.loss[0],
                            dims_list[0])))
    return 0
  variants = list(args.variants) + (
      [transformer_report.FLOOR] if args.floor and transformer_report.FLOOR not in args.variants else [])
  records = transformer_report.Fastest([
      Run(variants, args.L, Pairs(args.K, args.M), args.steps,
          dtypes=args.dtype, intra_op_threads=args.intra_op_threads,
          losses=args.loss, dims_list=dims_list)
      for _ in range(args.rounds)])
  torch_python, note = torch_common.TorchPython(args.torch_python)
  print('[bench] ' + note, file=sys.stderr, flush=True)
  autocast = ('bfloat16' in args.dtype if args.bf16_autocast is None
              else args.bf16_autocast)
  records = torch_common.WithTransformerRecords(
      records, torch_python, args.L, Pairs(args.K, args.M), args.steps,
      dims_list=[dict(model_dim=d['d_model'], hidden=d['hidden'],
                      time_steps=d['seq'], batch=d['batch'],
                      heads=d['heads']) for d in dims_list],
      bf16_autocast=autocast)
  if args.markdown:
    print(transformer_report.MarkdownLadder(records))
    print()
    print(transformer_report.Markdown(records))
    if len(args.dtype) > 1:
      print()
      print(transformer_report.MarkdownDtypes(records))
  else:
    for r in records:
      print(json.dumps(r))
  return 0


if __name__ == '__main__':
  sys.exit(main())
