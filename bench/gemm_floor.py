"""The GEMM floor of a training step: its matmuls at the machine's own pace.

`MatmulShapes` counts the matmuls (MatMul, BatchMatMul*) a fetch runs in a
graph whose ops carry static shapes (cells inline: a cell function's body
has no shapes in the outer graph), keyed by op type, operand shapes,
transposes and dtype; only the ops the fetch depends on count (tf.gradients
adds gradients a session then prunes, e.g. of a constant operand). `Floor`
times each distinct matmul in this process, on the thread pools the step
ran on. The floor (`floor_ms`) is the step's matmul FLOPs at the best pace
among its shapes (the peak; a broadcasting BatchMatMul timed as the one
GEMM it equals: `Timed`); `shapes_ms` sums count x time, each shape at its
own pace (the kernels as TensorFlow runs them). A variant's step over the
floor says how far it is from the limit.

bench/transformer.py's 'floor' rows; see docs/benchmarks.md.
"""

import collections
import math
import statistics
import time

MATMUL_TYPES = ('MatMul', 'BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3')
# Each timed run does about this many FLOPs (copies of one matmul), so that
# Session.run's own cost does not count as the matmul's.
_RUN_FLOPS = 2e8
_MAX_COPIES = 256

Key = collections.namedtuple('Key', 'op a b transpose_a transpose_b dtype')


def _Reachable(fetches):
  """The ops the fetches depend on (data and control inputs)."""
  seen, stack = set(), [f if hasattr(f, 'inputs') else f.op for f in fetches]
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    stack += [t.op for t in op.inputs] + list(op.control_inputs)
  return seen


_CALL_TYPES = ('PartitionedCall', 'StatefulPartitionedCall')


def _Body(op, root):
  """The ops of a call op's function (Lingvo's py_utils.Function: a custom
  gradient's forward and backward), from the graph that defines it."""
  name = op.get_attr('f').name
  for graph in (op.graph, root):
    fn = graph._get_function(name)  # pylint: disable=protected-access
    if fn is not None:
      return fn.graph.get_operations()
  raise ValueError('%s calls %s, not found in the graph' % (op.name, name))


def MatmulShapes(fetches) -> collections.Counter:
  """{Key: how many} of the matmuls the fetches run, in the functions they
  call too; raises ValueError on a matmul without a static shape (give the
  graph with cells inline)."""
  out = collections.Counter()
  root = fetches[0].graph
  ops = list(_Reachable(fetches))
  while ops:
    op = ops.pop()
    if op.type in _CALL_TYPES:
      ops += _Body(op, root)
      continue
    if op.type not in MATMUL_TYPES:
      continue
    a, b = op.inputs[0].shape, op.inputs[1].shape
    if not (a.is_fully_defined() and b.is_fully_defined()):
      raise ValueError('%s has no static shape (%s x %s)' % (op.name, a, b))
    if op.type == 'MatMul':
      ta, tb = op.get_attr('transpose_a'), op.get_attr('transpose_b')
    else:
      ta, tb = op.get_attr('adj_x'), op.get_attr('adj_y')
    out[Key(op.type, tuple(a.as_list()), tuple(b.as_list()), bool(ta),
            bool(tb), op.inputs[0].dtype.name)] += 1
  return out


def Flops(key: Key) -> int:
  """2 m k n per (broadcast) batch element: a multiply-add counts 2."""
  a, b = list(key.a), list(key.b)
  m, k = (a[-1], a[-2]) if key.transpose_a else (a[-2], a[-1])
  n = b[-2] if key.transpose_b else b[-1]
  batch_a, batch_b = a[:-2], b[:-2]
  nd = max(len(batch_a), len(batch_b))
  batch_a = [1] * (nd - len(batch_a)) + batch_a
  batch_b = [1] * (nd - len(batch_b)) + batch_b
  batch = math.prod(max(x, y) for x, y in zip(batch_a, batch_b))
  return 2 * batch * m * k * n


def TotalFlops(shapes) -> int:
  return sum(Flops(k) * n for k, n in shapes.items())


def Timed(key: Key) -> Key:
  """The matmul the floor times for `key`: a BatchMatMul with one 2-D
  operand (a [..., m, k] activation by a [k, n] weight, as Lingvo's FCLayer
  multiplies) as the one [batch m, k] x [k, n] GEMM it equals (same FLOPs;
  TensorFlow's batched kernel runs it as `batch` small GEMMs), others as
  they are."""
  a, b = list(key.a), list(key.b)
  if key.op == 'MatMul' or (len(a) > 2 and len(b) > 2):
    return key
  k = a[-2] if key.transpose_a else a[-1]
  n = b[-2] if key.transpose_b else b[-1]
  rows = Flops(key) // (2 * k * n)
  return Key('MatMul', (rows, k), (k, n), False, False, key.dtype)


def _Op(tf, key, a, b):
  if key.op == 'MatMul':
    return tf.matmul(a, b, transpose_a=key.transpose_a,
                     transpose_b=key.transpose_b)
  return tf.linalg.matmul(a, b, adjoint_a=key.transpose_a,
                          adjoint_b=key.transpose_b)


def TimingConfig(config):
  """`config` with Grappler off: its pruning drops matmuls whose outputs
  only a control dependency uses (the timed runs' copies), so they would
  not run at all."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  out = tf.config_pb2.ConfigProto()
  out.CopyFrom(config)
  out.graph_options.rewrite_options.disable_meta_optimizer = True
  return out


def Seconds(key: Key, config, min_seconds: float = 0.3,
            min_runs: int = 3) -> float:
  """One matmul's median time in this process, as `config`'s session runs
  it: copies of it in one run (each its own left operand, so that no graph
  pass merges them) fill the inter-op threads as a pipeline's devices do."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  key = Timed(key)
  copies = int(min(_MAX_COPIES, max(2, math.ceil(_RUN_FLOPS / Flops(key)))))
  graph = tf.Graph()
  with graph.as_default():
    dtype = tf.as_dtype(key.dtype)
    rnd = lambda shape, seed: tf.cast(  # pylint: disable=g-long-lambda
        tf.random.normal(shape, seed=seed, stddev=0.1), dtype)
    b = tf.Variable(rnd(key.b, 1), name='b')
    a_list = [tf.Variable(rnd(key.a, 2 + i), name='a%d' % i)
              for i in range(copies)]
    run = tf.group([_Op(tf, key, a, b) for a in a_list])
    init = tf.global_variables_initializer()
  times = []
  with tf.Session(graph=graph, config=TimingConfig(config)) as sess:
    sess.run(init)
    sess.run(run)  # Warm-up: the executor and the kernels' first calls.
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
      t = time.perf_counter()
      sess.run(run)
      times.append(time.perf_counter() - t)
  return statistics.median(times) / copies


def Floor(shapes, config, min_seconds: float = 0.3) -> dict:
  """The floor of a step running `shapes` ({Key: count}).

  Returns matmul_gflop (the step's), peak_gflops (the best pace among the
  shapes with 1% or more of the FLOPs), floor_ms (the FLOPs at that peak),
  shapes_ms (each shape at its own measured pace, summed: the kernels as
  TensorFlow runs them) and by_shape: per Key, its count, GFLOP/s and share
  of shapes_ms.
  """
  seconds = {k: Seconds(k, config, min_seconds) for k in shapes}
  shapes_s = sum(seconds[k] * n for k, n in shapes.items())
  flops = TotalFlops(shapes)
  peak = max(Flops(k) / seconds[k] for k, n in shapes.items()
             if Flops(k) * n >= 0.01 * flops)
  floor_s = flops / peak
  by_shape = [
      dict(op=k.op, a=list(k.a), b=list(k.b), transpose_a=k.transpose_a,
           transpose_b=k.transpose_b, dtype=k.dtype, count=n,
           gflops=round(Flops(k) / seconds[k] / 1e9, 2),
           shapes_share=round(seconds[k] * n / shapes_s, 4))
      for k, n in sorted(shapes.items(), key=lambda x: -seconds[x[0]] * x[1])]
  return dict(matmul_flops=flops, matmul_gflop=round(flops / 1e9, 4),
              # Significant digits: a tiny step's floor is still > 0.
              floor_ms=float('%.4g' % (1e3 * floor_s)),
              shapes_ms=float('%.4g' % (1e3 * shapes_s)),
              peak_gflops=float('%.4g' % (peak / 1e9)),
              by_shape=by_shape)
