"""GPipe step time: lingvo.core.gpipe vs lingvo_ext vs the plain model.

Builds the same FC model (same seed, same weights) three ways: with
`lingvo.core.gpipe.PipeliningLayer` (the anchor), with
`lingvo_ext.core.gpipe.PipeliningLayer` at its default params (so it always
measures the current default schedule), and as a plain unpipelined stack. Each
runs in its own graph and session on 2 logical CPU devices with 2 inter-op and
1 intra-op threads. A training step is the one a pipeline user writes: the
last layer (`PerExampleLoss`, in the last cell) gives each example's sum of
squares of the FC stack's output, the loss is their sum (linear in the
pipeline's outputs, so '1f1b' needs no recomputation), then tf.gradients and
an SGD assign_sub. All three models compute the same FLOPs.

For each model and (K cells, M micro-batches) the timed steps alternate the
implementations round-robin in one process, and the median is reported. Peak
RSS comes from a fresh child process per (implementation, configuration).

  .venv/bin/python bench/pipeline.py                 # the full sweep, JSON lines
  .venv/bin/python bench/pipeline.py --markdown      # the same, as a markdown table
  .venv/bin/python bench/pipeline.py --quick         # a reduced sweep
  .venv/bin/python bench/pipeline.py --quick --trace /tmp/trace   # + timelines
  .venv/bin/python bench/pipeline.py --models transformer --markdown
      # Lingvo's GPipeTransformerStack, see bench/transformer.py
  .venv/bin/python bench/pipeline.py --dtype float32,bfloat16 --K 2 --M 4 \
      --models homogeneous --markdown
      # lingvo_ext's pipeline in float32 and in bfloat16 (fprop_dtype, float32
      # variables) side by side: step time and bytes between cells per step

With a torch venv (`bash scripts/torch_venv.sh` makes .venv-torch, used by
default; or `--torch_python PATH`), bench/torch_baselines.py runs the
homogeneous model in torch (eager, and torch.distributed.pipelining at the
same K and M) in a subprocess, from the plain model's initial weights, and its
rows join the records and the markdown; with `--models transformer`, torch's
nn.TransformerEncoderLayer stack at the same sizes (see bench/transformer.py).

See docs/benchmarks.md for what the numbers mean.
"""

import argparse
import importlib
import json
import multiprocessing
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-import-not-at-top,g-bad-import-order
import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
from lingvo.core import base_layer  # pylint: disable=g-import-not-at-top
from lingvo.core import builder_layers  # pylint: disable=g-import-not-at-top
from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
from lingvo.core import gpipe as lingvo_gpipe  # pylint: disable=g-import-not-at-top
from lingvo.core import layers  # pylint: disable=g-import-not-at-top
from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
from lingvo.core import tshape  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from lingvo_ext.tracing import step_trace  # pylint: disable=g-import-not-at-top
from bench import harness  # pylint: disable=g-import-not-at-top
from bench import torch_baselines  # pylint: disable=g-import-not-at-top
from bench import transformer  # pylint: disable=g-import-not-at-top
from lingvo_ext.core import gpipe as ext_gpipe  # pylint: disable=g-import-not-at-top
from lingvo_ext.core import precision  # pylint: disable=g-import-not-at-top
from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top

py_utils.SetEagerMode(False)

IMPLS = ('lingvo', 'lingvo_ext', 'plain')
# lingvo_ext schedule variants timed beside the default ('lingvo_ext', the
# default params: 'unrolled'), each as impl 'lingvo_ext/<variant>'.
EXT_VARIANTS = ('unrolled+recompute', '1f1b', 'recurrent')
MODELS = ('homogeneous', 'heterogeneous')
NUM_DEVICES = 2
NUM_LAYERS = 8
# Layer widths of the heterogeneous model, as multiples of --width: per-layer
# FLOPs differ by up to 16x, so cells cannot be balanced exactly.
HETERO_WIDTHS = (1, 2, 0.5, 0.25, 1, 2, 1, 0.25, 1)
LEARNING_RATE = 1e-6
# A pipeline's loss must equal the plain model's on the first step.
LOSS_RTOL = 1e-4

FULL = dict(width=1536, batch=128, K=[1, 2], M=[1, 2, 4, 8, 16, 32],
            steps=20, warmup=3, rss='spawn', schedules=list(EXT_VARIANTS))
QUICK = dict(width=256, batch=32, K=[1, 2], M=[1, 4], steps=10, warmup=3,
             rss='fork', schedules=['1f1b'])


def _Log(msg: str) -> None:
  print('[bench] ' + msg, file=sys.stderr, flush=True)


# --- Models -------------------------------------------------------------------


def Widths(model: str, width: int) -> List[int]:
  """The NUM_LAYERS + 1 activation widths of a model."""
  if model == 'homogeneous':
    return [width] * (NUM_LAYERS + 1)
  if model == 'heterogeneous':
    return [max(1, int(round(width * m))) for m in HETERO_WIDTHS]
  raise ValueError('Unknown model %r; use one of %s.' % (model, MODELS))


def LayerParams(model: str, width: int) -> List:
  """FC layer params with explicit per-layer seeds: equal weights anywhere."""
  widths = Widths(model, width)
  return [
      layers.FCLayer.Params().Set(
          name='fc%d' % i, input_dim=a, output_dim=b,
          params_init=py_utils.WeightInit.Gaussian(1.0 / np.sqrt(a),
                                                   seed=i + 1))
      for i, (a, b) in enumerate(zip(widths, widths[1:]))
  ]


class PerExampleLoss(base_layer.BaseLayer):
  """[batch, d] -> [batch]: each example's sum of squares, its loss."""

  def FProp(self, theta, x):
    del theta
    return tf.reduce_sum(tf.square(x), axis=-1)

  @classmethod
  def FPropMeta(cls, p, x):
    return py_utils.NestedMap(
        flops=2 * x.num_elements(),
        out_shapes=(tshape.Shape(x.ToTensorShape().as_list()[:-1]),))


def Cells(model: str, width: int, batch: int, num_cells: int,
          per_example_loss: bool = False) -> List:
  """lingvo_ext FeatureExtractionLayer params: min-max FLOPs partition.

  With `per_example_loss`, a `PerExampleLoss` layer ends the last cell.
  """
  shape = tshape.Shape([batch, Widths(model, width)[0]])
  layer_params = LayerParams(model, width)
  if per_example_loss:
    layer_params.append(PerExampleLoss.Params().Set(name='loss'))
  return ext_gpipe.PartitionSequentialLayers(layer_params, num_cells, shape)


def CellFlops(cells: Sequence, model: str, width: int, batch: int) -> List[int]:
  shape = tshape.Shape([batch, Widths(model, width)[0]])
  out = []
  for c in cells:
    meta = c.cls.FPropMeta(c, shape)
    out.append(int(meta.flops))
    shape = meta.out_shapes[0]
  return out


def SlowestToMean(cell_flops: Sequence[int]) -> float:
  return float(max(cell_flops) / np.mean(cell_flops))


def IdealMs(plain_ms: float, num_cells: int, num_micro: int) -> float:
  """plain x (M+K-1)/(M K) x 4/3 (bubble and recompute); plain for K=1."""
  if num_cells == 1:
    return plain_ms
  return (plain_ms * (num_micro + num_cells - 1) / (num_micro * num_cells) *
          4.0 / 3.0)


INTER_OP_THREADS, INTRA_OP_THREADS = 2, 1


def SessionConfig():
  return tf.config_pb2.ConfigProto(
      device_count={'CPU': NUM_DEVICES},
      inter_op_parallelism_threads=INTER_OP_THREADS,
      intra_op_parallelism_threads=INTRA_OP_THREADS)


def PinThreadPools() -> None:
  """Gives TensorFlow's process-wide pools SessionConfig's thread counts.

  Call before building any graph. lingvo_ext's cell functions are
  tf.functions, and defining one starts TensorFlow's eager context, whose
  pools (TensorFlow's defaults: a thread per core) every later session then
  shares, whatever its config says; Lingvo's pipeline defines none. Without
  this, which pools a session got depended on which implementation a
  process built first.
  """
  try:
    tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    tf.config.threading.set_intra_op_parallelism_threads(INTRA_OP_THREADS)
  except RuntimeError as e:  # The eager context already started.
    _Log('WARNING thread pools not pinned: %s' % e)


def _BuildPipeline(gpipe_module, cells: Sequence, num_micro_batches: int,
                   **params):
  """`gpipe_module.PipeliningLayer` over `cells`, other params default."""
  cell_tpl = [
      gpipe_module.FeatureExtractionLayer.Params().Set(
          name=c.name, sub=[s.Copy() for s in c.sub]) for c in cells
  ]
  return gpipe_module.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cell_tpl, num_micro_batches=num_micro_batches,
      **params).Instantiate()


def VariantParams(variant: str) -> Dict:
  """'<schedule>[+recompute][+functions|+inline][+jit]' -> layer params."""
  schedule, *extras = variant.split('+')
  flags = {'recompute': ('recompute', True),
           'functions': ('cell_functions', True),
           'inline': ('cell_functions', False), 'jit': ('jit_compile', True)}
  if schedule not in records.NAMES or not set(
      extras) <= set(flags):
    raise ValueError('Unknown lingvo_ext variant %r; use <schedule> with '
                     'optional +recompute, +functions (cell_functions, the '
                     'default), +inline (cell_functions=False) or +jit '
                     '(jit_compile), schedule one of %s.' %
                     (variant, records.NAMES))
  params = dict(schedule=schedule)
  for extra in extras:
    name, value = flags[extra]
    params[name] = value
  return params


def OneDnnEnabled() -> bool:
  """Whether TensorFlow runs oneDNN kernels here (TF_ENABLE_ONEDNN_OPTS)."""
  from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
  return bool(_pywrap_util_port.IsMklEnabled())


def ExtOnlyParams() -> Dict[str, str]:
  """lingvo_ext PipeliningLayer params Lingvo lacks, at their defaults."""
  ext = ext_gpipe.PipeliningLayer.Params()
  ours = dict(ext.IterParams())
  theirs = dict(lingvo_gpipe.PipeliningLayer.Params().IterParams())
  return {k: repr(v) for k, v in sorted(ours.items()) if k not in theirs}


class Step:
  """One implementation's training step in its own graph and session."""

  def __init__(self, impl: str, model: str, width: int, batch: int,
               num_cells: int, num_micro: int, colocate: bool = False,
               dtype: str = 'float32', num_devices: Optional[int] = None):
    """`num_devices`: the pipelines' devices (default one per cell; fewer
    put the cells on them round robin). `dtype` 'bfloat16': fprop_dtype=tf.bfloat16 (Lingvo's mixed
    precision: float32 variables and updates, bfloat16 cells, activations
    and their gradients between cells); the input is cast to it."""
    self.impl = impl
    # With fprop_dtype the micro-batch steps (the first input's dtype
    # otherwise) stay float32.
    bf16 = dict(fprop_dtype=tf.bfloat16) if dtype == 'bfloat16' else {}
    ext_bf16 = dict(bf16, state_dtype=tf.float32) if bf16 else {}
    cells = Cells(model, width, batch, num_cells, per_example_loss=True)
    graph = tf.Graph()
    num_split = 1 if impl == 'plain' else min(num_cells,
                                              num_devices or num_cells)
    with graph.as_default(), cluster_factory.ForTestingWorker(
        mode='sync', job='trainer_client', cpus=num_split,
        split_size=num_split):
      tf.random.set_seed(1)
      py_utils.GetOrCreateGlobalStepVar()
      x = tf.constant(
          np.random.RandomState(0).randn(batch, Widths(model, width)[0]),
          dtype=tf.float32)
      x = tf.cast(x, dtype)
      if impl == 'plain':
        net = builder_layers.SequentialLayer.Params().Set(
            name='plain', sub=[s.Copy() for c in cells for s in c.sub],
            **bf16).Instantiate()
      elif impl == 'lingvo':
        net = _BuildPipeline(lingvo_gpipe, cells, num_micro, **bf16)
      elif impl == 'lingvo_ext':
        net = _BuildPipeline(ext_gpipe, cells, num_micro, **ext_bf16)
      elif impl.startswith('lingvo_ext/'):
        net = _BuildPipeline(ext_gpipe, cells, num_micro,
                             **VariantParams(impl[len('lingvo_ext/'):]),
                             **ext_bf16)
      else:
        raise ValueError('Unknown impl %r; use one of %s.' % (impl, IMPLS))
      y = net.FPropDefaultTheta(x)
      # Per-example losses from the last cell, summed: linear in y.
      self.loss = tf.reduce_sum(tf.cast(y, tf.float32))
      variables = net.vars.Flatten()
      self.variables = variables
      grads = tf.gradients(self.loss, variables,
                           colocate_gradients_with_ops=colocate)
      self.train = tf.group(*[
          tf.assign_sub(v, LEARNING_RATE * g)
          for v, g in zip(variables, grads)
      ])
      init = tf.global_variables_initializer()
    # Bytes of the activations and gradients sent between the cells'
    # devices per step (from the graph's static shapes).
    self.cross_bytes, self.cross_bytes_by_dtype = precision.CrossDeviceBytes(
        graph)
    graph.finalize()
    self.sess = tf.Session(graph=graph, config=SessionConfig())
    self.sess.run(init)

  def FirstLoss(self) -> float:
    return float(self.sess.run(self.loss))

  def Run(self) -> float:
    t = time.perf_counter()
    self.sess.run(self.train)
    return time.perf_counter() - t

  def Close(self) -> None:
    self.sess.close()


# --- Timing -------------------------------------------------------------------


def TimeRoundRobin(steps: Dict[str, Step], num_steps: int,
                   warmup: int) -> Dict[str, List[float]]:
  """Warms each step up, then times them interleaved; seconds per impl.

  The order rotates every round so no implementation always runs right after
  the same other one.
  """
  for s in steps.values():
    for _ in range(warmup):
      s.Run()
  names = list(steps)
  times = {n: [] for n in names}
  for r in range(num_steps):
    k = r % len(names)
    for n in names[k:] + names[:k]:
      times[n].append(steps[n].Run())
  return times


# --- Peak RSS in a fresh process ----------------------------------------------


# One reader of /proc/self/status for both benches (torch_baselines imports
# only the standard library and numpy at module level).
_RssMb = torch_baselines.RssMb


def ChildPeakRss(job: Dict) -> Dict:
  """Runs in the child: builds one step, runs it, returns its peak RSS (MB).

  Args:
    job: impl, model, width, batch, K, M, steps.

  Returns:
    peak_rss_mb (the process's peak resident set, VmHWM or ru_maxrss) and
    base_rss_mb (resident set before the graph was built).
  """
  PinThreadPools()
  base = _RssMb('VmRSS')
  s = Step(job['impl'], job['model'], job['width'], job['batch'], job['K'],
           job['M'], job.get('colocate', False),
           num_devices=job.get('devices'))
  for _ in range(job['steps']):
    s.Run()
  s.Close()
  peak = _RssMb('VmHWM')
  if peak is None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
  return dict(peak_rss_mb=peak, base_rss_mb=base)


class RssMeter:
  """Measures peak RSS per job in fresh processes.

  'fork': children forked from a server process that has only imported TF,
  Lingvo and this module (multiprocessing's forkserver), so no import cost
  per child. 'spawn': a new interpreter per job (`--_child`), which pays
  those imports each time. 'none': no measurement.
  """

  def __init__(self, mode: str, timeout_s: float = 600):
    self.mode = mode
    self.timeout_s = timeout_s
    self._ctx = None
    if mode == 'fork':
      self._ctx = multiprocessing.get_context('forkserver')
      self._ctx.set_forkserver_preload(['bench.pipeline'])
      # Pickled by module path so the forkserver child can find it.
      self._fn = importlib.import_module('bench.pipeline').ChildPeakRss

  def Measure(self, job: Dict) -> Dict:
    if self.mode == 'none':
      return dict(peak_rss_mb=None, base_rss_mb=None)
    try:
      if self.mode == 'fork':
        with self._ctx.Pool(1, maxtasksperchild=1) as pool:
          return pool.apply_async(self._fn, (job,)).get(self.timeout_s)
      out = subprocess.run(
          [sys.executable, os.path.abspath(__file__), '--_child',
           json.dumps(job)], capture_output=True, text=True,
          timeout=self.timeout_s, check=True).stdout
      return json.loads(out.strip().splitlines()[-1])
    except Exception as e:  # pylint: disable=broad-except
      _Log('peak RSS of %s failed: %r' % (job, e))
      return dict(peak_rss_mb=None, base_rss_mb=None)


# --- torch baselines (bench/torch_baselines.py, in the torch venv) ------------


# The torch python: --torch_python, else .venv-torch's when it exists.
TorchPython = torch_baselines.TorchPython


def SavePlainWeights(step: 'Step', path: str) -> None:
  """The plain model's current weights as w<i> [in, out], b<i> [out]."""
  arrays = {}
  for v, value in zip(step.variables, step.sess.run(step.variables)):
    # SequentialLayer names its layers cell_000, cell_001, ...
    match = re.search(r'(\d+)/(w|b)(/var)?$', v.op.name)
    if not match:
      raise ValueError('Unexpected variable %s in the plain model.' %
                       v.op.name)
    arrays['%s%d' % (match.group(2), int(match.group(1)))] = value
  if len(arrays) != 2 * NUM_LAYERS:
    raise ValueError('Expected w and b of %d layers, got %s.' %
                     (NUM_LAYERS, sorted(arrays)))
  np.savez(path, **arrays)


def TorchRecords(args, plain: 'Step', plain_loss: float) -> List[Dict]:
  """Runs bench/torch_baselines.py on the homogeneous model; its records.

  The torch models start from `plain`'s weights (call before training it), so
  their first-step losses must equal `plain_loss`. A failure is logged, not
  raised: the TensorFlow figures still come out.
  """
  with tempfile.TemporaryDirectory(prefix='bench_torch_') as tmp:
    npz = os.path.join(tmp, 'init.npz')
    SavePlainWeights(plain, npz)
    cmd = [args.torch_python,
           os.path.join(_REPO, 'bench', 'torch_baselines.py'),
           '--width', str(args.width), '--batch', str(args.batch),
           '--layers', str(NUM_LAYERS), '--K'] + [str(k) for k in args.K] + [
               '--M'] + [str(m) for m in args.M] + [
                   '--steps', str(args.steps), '--warmup', str(args.warmup),
                   '--init_npz', npz, '--timeout_s', str(args.torch_timeout_s)]
    _Log('torch baselines: ' + ' '.join(cmd))
    try:
      out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                           timeout=args.torch_timeout_s * (1 + 2 * len(
                               args.K) * len(args.M)))
    except (OSError, subprocess.TimeoutExpired) as e:
      _Log('WARNING torch baselines failed: %r' % e)
      return []
  if out.returncode != 0:
    _Log('WARNING torch baselines failed (exit %d): %s' %
         (out.returncode, out.stderr.strip()[-2000:]))
    return []
  records = [json.loads(l) for l in out.stdout.splitlines() if l.strip()]
  for r in records:
    r['loss_rel_diff'] = float('%.3g' % (abs(r['first_loss'] - plain_loss) /
                                         max(abs(plain_loss), 1e-30)))
    if r['loss_rel_diff'] > LOSS_RTOL:
      msg = '%s K=%d M=%d: first-step loss %r, TensorFlow plain %r' % (
          r['impl'], r['K'], r['M'], r['first_loss'], plain_loss)
      if args.check:
        raise AssertionError(msg)
      _Log('WARNING ' + msg)
  return records


def _Fmt(x, fmt='%.1f') -> str:
  """A table cell: '-' for a missing value."""
  return '-' if x is None else fmt % x


def MarkdownVsTorch(records: Sequence[Dict]) -> str:
  """One row per (model, K, M) with lingvo_ext: it against TF and torch."""
  torch_by = {}
  tf_by = {}
  for r in records:
    if r.get('framework') == 'torch':
      torch_by.setdefault(r['model'], {})[(r['impl'], r['K'], r['M'])] = r
    else:
      tf_by.setdefault((r['model'], r['K'], r['M']), {})[r['impl']] = r

  def _Ms(r):
    return None if r is None else r['step_ms']

  def _Ratio(a, b):
    return None if a is None or b is None else a / b

  lines = [
      '| model | K | M | lingvo_ext ms | TF plain ms | torch plain ms '
      '| torch GPipe ms | torch 1F1B ms | ext / TF plain | ext / torch plain '
      '| ext / torch GPipe | ext / torch 1F1B |',
      '|' + '---|' * 12,
  ]
  for (model, k, m), c in tf_by.items():
    t = torch_by.get(model)
    if not t or 'lingvo_ext' not in c:
      continue
    ext = _Ms(c['lingvo_ext'])
    tf_plain = _Ms(c.get('plain'))
    t_plain = _Ms(t.get(('torch/plain', 1, 1)))
    gpipe = _Ms(t.get(('torch/gpipe', k, m)))
    f1b = _Ms(t.get(('torch/1f1b', k, m)))
    lines.append('| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s '
                 '|' % (model, k, m, _Fmt(ext), _Fmt(tf_plain), _Fmt(t_plain),
                        _Fmt(gpipe), _Fmt(f1b),
                        _Fmt(_Ratio(ext, tf_plain), '%.2f'),
                        _Fmt(_Ratio(ext, t_plain), '%.2f'),
                        _Fmt(_Ratio(ext, gpipe), '%.2f'),
                        _Fmt(_Ratio(ext, f1b), '%.2f')))
  return '\n'.join(lines)


# --- Timelines ----------------------------------------------------------------


def _HostTrace(sess, fetch):
  """One step under TF's profiler: a trace_events_pb2.Trace, or None."""
  try:
    # pylint: disable=g-import-not-at-top
    from tensorflow.python.profiler.internal import _pywrap_profiler
    from tensorflow.tsl.profiler.protobuf import trace_events_pb2
    # pylint: enable=g-import-not-at-top
    trace = None
    for _ in range(2):  # The first profiled step pays set-up costs.
      session = _pywrap_profiler.ProfilerSession()
      session.start('', {'host_tracer_level': 2, 'python_tracer_level': 0,
                         'device_tracer_level': 0})
      try:
        sess.run(fetch)
      finally:
        data = session.stop()
      trace = trace_events_pb2.Trace()
      trace.ParseFromString(data)
    return trace
  except Exception as e:  # pylint: disable=broad-except
    _Log('host trace unavailable: %r' % e)
    return None


def TraceStep(step: Step, directory: str, name: str, title: str) -> Dict:
  """Writes one step's Chrome trace, host trace and Gantt PNG; returns stats.

  Files: <name>.trace.json (step stats via TF's timeline module),
  <name>.host_trace.json (profiler, ops inside loops too), <name>.png.
  """
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.client import timeline as tf_timeline
  # pylint: enable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
  metadata = None
  for _ in range(2):  # The first traced step re-instantiates functions.
    metadata = tf.RunMetadata()
    step.sess.run(step.train, options=options, run_metadata=metadata)
  prefix = os.path.join(directory, name)
  with open(prefix + '.trace.json', 'w') as f:
    f.write(tf_timeline.Timeline(
        metadata.step_stats).generate_chrome_trace_format())
  intervals = step_trace.BusyIntervals(metadata.step_stats)
  t0, t1 = step_trace.Span(intervals)
  host = _HostTrace(step.sess, step.train)
  host_events = step_trace.HostOpEvents(host) if host is not None else None
  if host is not None:
    step_trace.WriteJson(step_trace.HostTraceToChrome(host),
                         prefix + '.host_trace.json')
  idle = step_trace.PlotGantt(intervals, prefix + '.png', title=title,
                              host_events=host_events)
  stats = dict(
      name=name, idle_fraction=round(idle, 4), traced_span_ms=round(
          (t1 - t0) / 1e3, 3),
      busy_ms={d: round(sum(e - s for s, e in step_trace.Union(v)) / 1e3, 3)
               for d, v in intervals.items()},
      opaque_loops=[
          dict(device=d, node=n.node_name, ms=round(
              n.all_end_rel_micros / 1e3, 3))
          for dev in metadata.step_stats.dev_stats
          for d in [step_trace.ShortDevice(dev.device)]
          for n in dev.node_stats
          if step_trace.OpType(n.timeline_label) == 'While'
      ])
  if host_events:
    stats['host'] = step_trace.HostBreakdown(host_events)
  return stats


# --- The sweep ----------------------------------------------------------------


def Pipelines(args) -> List[str]:
  """The pipeline impls of a run: Lingvo's, lingvo_ext's default, variants."""
  return ['lingvo', 'lingvo_ext'] + ['lingvo_ext/' + v for v in args.schedules]


def _TraceConfig(args, steps: Dict[str, Step], model: str, k: int,
                 m: int) -> Dict[str, Dict]:
  """Traces one step of each pipeline (and of plain once per model)."""
  traces = {}
  impls = Pipelines(args)
  if k == args.K[0] and m == args.M[0]:
    impls.append('plain')
  for impl in impls:
    name = ('%s_%s' % (impl, model) if impl == 'plain' else
            '%s_%s_K%d_M%d' % (impl.replace('/', '_').replace('+', '_'),
                               model, k, m))
    title = '%s %s K=%d M=%d' % (impl, model, k, m)
    traces[impl] = TraceStep(steps[impl], args.trace, name, title)
    with open(os.path.join(args.trace, 'summary.jsonl'), 'a') as f:
      f.write(json.dumps(traces[impl]) + '\n')
  return traces


def _ConfigRecords(args, model: str, k: int, m: int,
                   times: Dict[str, List[float]], losses: Dict[str, float],
                   cell_ratio: float, traces: Dict[str, Dict]) -> Dict:
  """The JSON records of one configuration, RSS not yet filled in."""
  plain_loss = losses['plain']
  plain_ms = statistics.median(times['plain']) * 1e3
  ideal = IdealMs(plain_ms, k, m)
  recs = {}
  for impl in times:
    ms = [1e3 * t for t in times[impl]]
    rec = dict(
        impl=impl, model=model, K=k, M=m,
        step_ms=round(statistics.median(ms), 3), peak_rss_mb=None,
        width=args.width, batch=args.batch, steps=len(ms),
        p25_ms=round(float(np.percentile(ms, 25)), 3),
        p75_ms=round(float(np.percentile(ms, 75)), 3),
        colocate_gradients=args.colocate, rss_mode=args.rss,
        onednn=OneDnnEnabled(),
        first_loss=losses[impl],
        loss_rel_diff=float('%.3g' % (abs(losses[impl] - plain_loss) /
                                      max(abs(plain_loss), 1e-30))),
        cell_cost_max_over_mean=round(cell_ratio, 4))
    rec['vs_plain'] = round(rec['step_ms'] / plain_ms, 4)
    rec['ideal_ms'] = round(ideal, 3)
    rec['vs_ideal'] = round(rec['step_ms'] / ideal, 4)
    if impl in traces:
      rec['idle_fraction'] = traces[impl]['idle_fraction']
      host = traces[impl].get('host')
      if host:
        rec['thread_idle_fraction'] = round(host['thread_idle_fraction'], 4)
    recs[impl] = rec
  for impl in recs:
    if impl.startswith('lingvo_ext'):
      recs[impl]['vs_lingvo'] = round(
          recs[impl]['step_ms'] / recs['lingvo']['step_ms'], 4)
      recs[impl]['vs_unrolled'] = round(
          recs[impl]['step_ms'] / recs['lingvo_ext']['step_ms'], 4)
  recs['lingvo_ext']['ext_params'] = ExtOnlyParams()
  for impl in recs:
    if impl.startswith('lingvo_ext/'):
      recs[impl]['ext_params'] = dict(
          ExtOnlyParams(), **{k: repr(v) for k, v in VariantParams(
              impl[len('lingvo_ext/'):]).items()})
  return recs


def _Emit(args, records: List[Dict], r: Dict) -> None:
  """Appends a record; prints it (unless --markdown) and adds it to --jsonl."""
  records.append(r)
  if not args.markdown:
    print(json.dumps(r), flush=True)
  if args.jsonl:
    with open(args.jsonl, 'a') as f:
      f.write(json.dumps(r) + '\n')


def RunSweep(args) -> List[Dict]:
  """Times every configuration; returns one record per (impl, model, K, M)."""
  rss = RssMeter(args.rss)
  records = []
  for model in args.models:
    _Log('%s: building the plain model' % model)
    job = dict(model=model, width=args.width, batch=args.batch,
               steps=args.rss_steps, colocate=args.colocate,
               devices=args.devices)
    # The plain model does not depend on K and M: one session and one RSS.
    plain = Step('plain', model, args.width, args.batch, 1, 1, args.colocate)
    plain_loss = plain.FirstLoss()
    if model == 'homogeneous' and args.torch_python:
      for r in TorchRecords(args, plain, plain_loss):
        _Emit(args, records, r)
    plain_rss = rss.Measure(dict(job, impl='plain', K=1, M=1))
    for k in args.K:
      cell_ratio = SlowestToMean(
          CellFlops(Cells(model, args.width, args.batch, k,
                          per_example_loss=True), model, args.width,
                    args.batch))
      for m in args.M:
        t_cfg = time.time()
        steps = {'plain': plain}
        losses = {'plain': plain_loss}
        for impl in Pipelines(args):
          steps[impl] = Step(impl, model, args.width, args.batch, k, m,
                             args.colocate, num_devices=args.devices)
          losses[impl] = steps[impl].FirstLoss()
        bad = {i: l for i, l in losses.items()
               if abs(l - plain_loss) > LOSS_RTOL * abs(plain_loss)}
        if bad:
          msg = '%s K=%d M=%d: first-step losses differ: %s' % (model, k, m,
                                                                losses)
          if args.check:
            raise AssertionError(msg)
          _Log('WARNING ' + msg)
        times = TimeRoundRobin(steps, args.steps, args.warmup)
        traces = _TraceConfig(args, steps, model, k, m) if args.trace else {}
        for impl in Pipelines(args):
          steps[impl].Close()
        recs = _ConfigRecords(args, model, k, m, times, losses, cell_ratio,
                              traces)
        for impl in Pipelines(args):
          recs[impl].update(rss.Measure(dict(job, impl=impl, K=k, M=m)))
        recs['plain'].update(plain_rss)
        for impl in recs:
          for key in ('peak_rss_mb', 'base_rss_mb'):
            if recs[impl].get(key) is not None:
              recs[impl][key] = round(recs[impl][key], 1)
          records.append(recs[impl])
          if not args.markdown:
            print(json.dumps(recs[impl]), flush=True)
        if args.jsonl:
          with open(args.jsonl, 'a') as f:
            for impl in recs:
              f.write(json.dumps(recs[impl]) + '\n')
        _Log('%s K=%d M=%d: %s (%.0f s)' % (
            model, k, m, ', '.join('%s %.1f ms' % (i, r['step_ms'])
                                   for i, r in recs.items()),
            time.time() - t_cfg))
    plain.Close()
  return records


def RunDtypes(args) -> List[Dict]:
  """lingvo_ext's pipelines in each of --dtype, timed side by side.

  The default schedule and each of --schedules, in float32 and in bfloat16
  (fprop_dtype), round-robin in one process per (model, K, M); each record
  has the step time and the bytes sent between the cells' devices per step.
  """
  records = []
  impls = ['lingvo_ext'] + ['lingvo_ext/' + v for v in args.schedules]
  # The machine's, the same for every record: read once.
  machine = dict(onednn=OneDnnEnabled(),
                 cpu_bf16_units=precision.CpuHasBf16Units())
  for model in args.models:
    for k in args.K:
      for m in args.M:
        steps, losses = {}, {}
        for impl in impls:
          for dtype in args.dtype:
            key = (impl, dtype)
            steps[key] = Step(impl, model, args.width, args.batch, k, m,
                              args.colocate, dtype=dtype,
                              num_devices=args.devices)
            losses[key] = steps[key].FirstLoss()
        times = TimeRoundRobin(steps, args.steps, args.warmup)
        recs = {}
        for (impl, dtype), s in steps.items():
          ms = [1e3 * t for t in times[(impl, dtype)]]
          recs[(impl, dtype)] = dict(
              impl=impl, dtype=dtype, model=model, K=k, M=m,
              step_ms=round(statistics.median(ms), 3),
              p25_ms=round(float(np.percentile(ms, 25)), 3),
              p75_ms=round(float(np.percentile(ms, 75)), 3),
              bytes_between_cells=s.cross_bytes,
              bytes_by_dtype=s.cross_bytes_by_dtype,
              first_loss=losses[(impl, dtype)], width=args.width,
              batch=args.batch, steps=len(ms),
              colocate_gradients=args.colocate, **machine)
          s.Close()
        for (impl, dtype), r in recs.items():
          base = recs.get((impl, 'float32'))
          if base and dtype != 'float32':
            r['vs_float32'] = round(r['step_ms'] / base['step_ms'], 4)
            r['bytes_vs_float32'] = (
                round(r['bytes_between_cells'] / base['bytes_between_cells'],
                      4) if base['bytes_between_cells'] else None)
            r['first_loss_rel_diff'] = float('%.3g' % (
                abs(r['first_loss'] - base['first_loss']) /
                max(abs(base['first_loss']), 1e-30)))
          _Emit(args, records, r)
        _Log('%s K=%d M=%d: %s' % (model, k, m, ', '.join(
            '%s %s %.1f ms' % (i, d, r['step_ms'])
            for (i, d), r in recs.items())))
  return records


def MarkdownDtypes(records: Sequence[Dict]) -> str:
  """One row per (model, K, M, impl): bfloat16 beside float32."""
  by = {}
  for r in records:
    by.setdefault((r['model'], r['K'], r['M'], r['impl']),
                  {})[r['dtype']] = r
  lines = [
      '| model | K | M | impl | float32 ms | bf16 ms | bf16 / float32 '
      '| bytes between cells per step float32 / bf16 | first-loss rel. diff '
      '| oneDNN |',
      '|' + '---|' * 10,
  ]
  for (model, k, m, impl), d in by.items():
    f, b = d.get('float32'), d.get('bfloat16')
    if not f or not b:
      continue
    lines.append('| %s | %d | %d | %s | %s | %s | %s | %d / %d | %s | %s |' % (
        model, k, m, impl, _Fmt(f['step_ms']), _Fmt(b['step_ms']),
        _Fmt(b.get('vs_float32'), '%.2fx'), f['bytes_between_cells'],
        b['bytes_between_cells'], _Fmt(b.get('first_loss_rel_diff'), '%.2g'),
        transformer.OneDnnCell(b)))
  return '\n'.join(lines)


def Markdown(records: Sequence[Dict]) -> str:
  """One table row per (model, K, M)."""
  by_cfg = {}
  for r in records:
    by_cfg.setdefault((r['model'], r['K'], r['M']), {})[r['impl']] = r

  lines = [
      '| model | K | M | lingvo ms | lingvo_ext ms | plain ms | ext/lingvo '
      '| lingvo/plain | ext/plain | ideal ms | lingvo/ideal | ext/ideal '
      '| slowest/mean cell | peak RSS MB lingvo / ext / plain |',
      '|' + '---|' * 14,
  ]
  for (model, k, m), c in by_cfg.items():
    if not all(i in c for i in IMPLS):
      continue
    l, e, p = c['lingvo'], c['lingvo_ext'], c['plain']
    lines.append('| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s '
                 '| %s | %s / %s / %s |' % (
                     model, k, m, _Fmt(l['step_ms']), _Fmt(e['step_ms']),
                     _Fmt(p['step_ms']), _Fmt(e['vs_lingvo'], '%.2f'),
                     _Fmt(l['vs_plain'], '%.2f'), _Fmt(e['vs_plain'], '%.2f'),
                     _Fmt(l['ideal_ms']), _Fmt(l['vs_ideal'], '%.2f'),
                     _Fmt(e['vs_ideal'], '%.2f'),
                     _Fmt(l['cell_cost_max_over_mean'], '%.2f'),
                     _Fmt(l['peak_rss_mb'], '%.0f'),
                     _Fmt(e['peak_rss_mb'], '%.0f'),
                     _Fmt(p['peak_rss_mb'], '%.0f')))
  return '\n'.join(lines)


def MarkdownSchedules(records: Sequence[Dict]) -> str:
  """One row per (model, K, M, lingvo_ext impl): time and peak memory."""
  by_cfg = {}
  for r in records:
    by_cfg.setdefault((r['model'], r['K'], r['M']), {})[r['impl']] = r

  lines = [
      '| model | K | M | impl | ms | x plain | x unrolled (same M) '
      '| x lingvo | peak RSS MB | RSS - lingvo RSS MB |',
      '|' + '---|' * 10,
  ]
  for (model, k, m), c in by_cfg.items():
    lingvo = c.get('lingvo', {})
    for impl, r in c.items():
      if not impl.startswith('lingvo_ext'):
        continue
      rss_diff = None
      if r.get('peak_rss_mb') is not None and lingvo.get('peak_rss_mb'):
        rss_diff = r['peak_rss_mb'] - lingvo['peak_rss_mb']
      lines.append('| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s |' % (
          model, k, m, impl, _Fmt(r['step_ms']),
          _Fmt(r.get('vs_plain'), '%.2f'),
          _Fmt(r.get('vs_unrolled'), '%.2f'), _Fmt(r.get('vs_lingvo'), '%.2f'),
          _Fmt(r.get('peak_rss_mb'), '%.0f'), _Fmt(rss_diff, '%+.0f')))
  return '\n'.join(lines)


def ParseArgs(argv=None):
  parser = harness.Parser(__doc__, raw=True)
  parser.epilog = '\n'.join(__doc__.splitlines()[1:])
  parser.add_argument(
      '--quick', action='store_true',
      help='Reduced sweep: width %(w)d, batch %(b)d, K in %(K)s, M in %(M)s, '
      '%(s)d timed steps.' % dict(w=QUICK['width'], b=QUICK['batch'],
                                  K=QUICK['K'], M=QUICK['M'],
                                  s=QUICK['steps']))
  parser.add_argument('--width', type=int, help='Layer width (default %d, '
                      'quick %d).' % (FULL['width'], QUICK['width']))
  parser.add_argument('--batch', type=int, help='Batch size (default %d, '
                      'quick %d).' % (FULL['batch'], QUICK['batch']))
  parser.add_argument('--K', type=int, nargs='+', help='Numbers of cells.')
  parser.add_argument(
      '--devices', type=int,
      help='Devices the pipelines run on (default: one per cell). Fewer '
      'than K puts the cells on them round robin, K / D cells each, as '
      "'interleaved_1f1b' wants (e.g. --K 4 --devices 2).")
  parser.add_argument('--M', type=int, nargs='+',
                      help='Numbers of micro-batches.')
  parser.add_argument(
      '--models', nargs='+', choices=MODELS + ('transformer',),
      default=list(MODELS),
      help="FC models, or 'transformer': Lingvo's GPipeTransformerStack "
      'through lingvo.core.gpipe and lingvo_ext (bench/transformer.py; '
      '--K, --M, --steps and --markdown apply; L in --transformer_layers).')
  parser.add_argument('--transformer_layers', type=int, nargs='+',
                      default=[8, 32],
                      help="--models transformer: encoder layers (L).")
  parser.add_argument(
      '--schedules', nargs='*',
      help='lingvo_ext variants timed beside its default, as '
      '<schedule>[+recompute][+inline][+jit] (default: %s; quick: %s).' %
      (' '.join(FULL['schedules']), ' '.join(QUICK['schedules'])))
  parser.add_argument('--steps', type=int,
                      help='Timed steps per implementation (>= 10).')
  parser.add_argument('--warmup', type=int, help='Untimed steps first.')
  parser.add_argument('--rss', choices=('spawn', 'fork', 'none'),
                      help='Peak RSS from a fresh interpreter per '
                      'configuration (spawn, the default), a process forked '
                      'from a pre-imported server (fork, the --quick default: '
                      'no 7 s import each), or not at all.')
  parser.add_argument('--rss_steps', type=int, default=3,
                      help='Steps the peak-RSS child runs.')
  parser.add_argument('--jsonl', help='Also append the JSON lines here.')
  parser.add_argument('--from_jsonl',
                      help='Only render --markdown from a saved --jsonl file.')
  parser.add_argument('--trace', metavar='DIR',
                      help='Write a Chrome trace, a host trace and a Gantt PNG '
                      'of one step per configuration into DIR.')
  parser.add_argument('--colocate', action=argparse.BooleanOptionalAction,
                      default=True,
                      help='tf.gradients(colocate_gradients_with_ops=True), '
                      'as Lingvo\'s learner does and the README tells users '
                      'to (default); --no-colocate: plain tf.gradients, as '
                      'the issue\'s probe, which puts the whole backward '
                      'pass on CPU:0.')
  parser.add_argument('--check', action='store_true',
                      help='Fail if the first-step losses differ.')
  parser.add_argument(
      '--torch_python', metavar='PATH',
      help='A python with torch: also time bench/torch_baselines.py at the '
      'same sizes. Default: .venv-torch/bin/python if it exists; "none" '
      'turns it off (docs/benchmarks.md).')
  parser.add_argument('--torch_timeout_s', type=int, default=600,
                      help='Bound on each torch job (default %(default)s).')
  parser.add_argument(
      '--dtype', type=transformer.ParseDtypes, default=['float32'],
      help="'float32' (default), 'float32,bfloat16' or 'bfloat16': "
      "lingvo_ext's pipelines also with bfloat16 cells (docs/benchmarks.md).")
  parser.add_argument('--_child', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  base = QUICK if args.quick else FULL
  # --models transformer has defaults of its own for these.
  args.given = {key for key in ('K', 'M', 'steps')
                if getattr(args, key) is not None}
  for key in ('width', 'batch', 'K', 'M', 'steps', 'warmup', 'rss',
              'schedules'):
    if getattr(args, key) is None:
      setattr(args, key, base[key])
  if args.devices is not None and not 1 <= args.devices <= min(args.K):
    parser.error('--devices=%d: give 1 to the smallest --K (%d).' %
                 (args.devices, min(args.K)))
  if args.steps < 10 and not args._child:  # pylint: disable=protected-access
    parser.error('--steps must be >= 10 for a meaningful median.')
  for v in args.schedules:
    try:
      VariantParams(v)
    except ValueError as e:
      parser.error('--schedules: %s' % e)
  for m in args.M:
    if args.batch % m:
      parser.error('--batch %d is not divisible by M=%d.' % (args.batch, m))
  if torch_baselines.BadTorchPython(args.torch_python):
    parser.error(torch_baselines.BadTorchPython(args.torch_python))
  if not args._child:  # pylint: disable=protected-access
    args.torch_python, note = TorchPython(args.torch_python)
    if {'homogeneous', 'transformer'} & set(args.models):
      _Log(note)
  return args


def PrintMarkdown(records: Sequence[Dict]) -> None:
  print(Markdown(records))
  print()
  print(MarkdownSchedules(records))
  if any(r.get('framework') == 'torch' for r in records):
    print()
    print(MarkdownVsTorch(records))
    print()
    print(torch_baselines.Markdown(records))


def main(argv=None) -> int:
  args = ParseArgs(argv)
  child = args._child  # pylint: disable=protected-access
  if child:
    print(json.dumps(ChildPeakRss(json.loads(child))))
    return 0
  PinThreadPools()
  if args.from_jsonl:
    with open(args.from_jsonl) as f:
      records = [json.loads(l) for l in f if l.strip()]
    PrintMarkdown(records)
    return 0
  if 'transformer' in args.models:
    if len(args.models) > 1:
      _Log("--models transformer runs on its own; give it alone.")
      return 2
    pairs = transformer.Pairs(args.K if 'K' in args.given else [2, 4],
                              args.M if 'M' in args.given else [4, 16])
    steps = args.steps if 'steps' in args.given else 5
    variants = list(transformer.DEFAULT_VARIANTS)
    if 'bfloat16' in args.dtype:
      # Lingvo's GPipeTransformerStack in bfloat16 fails inside Lingvo's
      # StackedRecurrent (float32 and bfloat16 state gradients added), so
      # 'lingvo' and 'recurrent' are left out.
      variants = [v for v in variants if v.split('+')[0] in ('unrolled',
                                                             '1f1b')]
    records = transformer.Run(
        variants, args.transformer_layers, pairs, steps, dtypes=args.dtype)
    records = torch_baselines.WithTransformerRecords(
        records, args.torch_python, args.transformer_layers, pairs, steps)
    if args.markdown:
      print(transformer.Markdown(records))
      if len(args.dtype) > 1:
        print()
        print(transformer.MarkdownDtypes(records))
    else:
      for r in records:
        print(json.dumps(r))
    return 0
  t = time.time()
  if args.dtype != ['float32']:
    records = RunDtypes(args)
    if args.markdown:
      print(MarkdownDtypes(records))
    _Log('done in %.0f s' % (time.time() - t))
    return 0
  records = RunSweep(args)
  if args.markdown:
    PrintMarkdown(records)
  _Log('done in %.0f s' % (time.time() - t))
  if args.trace:
    _Log('traces: wrote *.trace.json (chrome://tracing), *.host_trace.json, '
         '*.png (Gantt charts) and summary.jsonl to %s' %
         os.path.abspath(args.trace))
  return 0


if __name__ == '__main__':
  sys.exit(main())
