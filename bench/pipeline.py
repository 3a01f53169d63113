"""GPipe step time: lingvo.core.gpipe vs lingvo_ext vs the plain model.

Builds the same FC model (same seed, same weights) three ways: with
`lingvo.core.gpipe.PipeliningLayer` (the anchor), with lingvo_ext's at its
default params, and as a plain unpipelined stack (bench/pipeline_step.py),
each in its own graph and session on 2 logical CPU devices. A step is the
one a pipeline user writes: a per-example loss in the last cell, summed,
tf.gradients and an SGD update. For each model and (K cells, M
micro-batches) the timed steps alternate the implementations round-robin in
one process and the median is reported; peak RSS comes from a fresh child
process per (implementation, configuration). The tables and traces are
bench/pipeline_report.py's.

  .venv/bin/python bench/pipeline.py                 # the full sweep, JSON lines
  .venv/bin/python bench/pipeline.py --markdown      # the same, as a markdown table
  .venv/bin/python bench/pipeline.py --quick         # a reduced sweep
  .venv/bin/python bench/pipeline.py --quick --trace /tmp/trace   # + timelines
  .venv/bin/python bench/pipeline.py --models transformer --markdown

`--dtype float32,bfloat16` runs both side by side; with a torch venv
(`bash scripts/torch_venv.sh`) torch's rows join (bench/torch_baselines.py).
See docs/benchmarks.md for what the numbers mean.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict
from typing import List

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-import-not-at-top,g-bad-import-order

# isort: split
from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from bench import harness  # pylint: disable=g-import-not-at-top
from bench import pipeline_report  # pylint: disable=g-import-not-at-top
from bench import pipeline_step  # pylint: disable=g-import-not-at-top
from bench import torch_common  # pylint: disable=g-import-not-at-top
from bench import transformer  # pylint: disable=g-import-not-at-top
from bench import transformer_report  # pylint: disable=g-import-not-at-top
from lingvo_ext.core import precision  # pylint: disable=g-import-not-at-top

py_utils.SetEagerMode(False)

# A pipeline's loss must equal the plain model's on the first step.
LOSS_RTOL = 1e-4

FULL = dict(width=1536, batch=128, K=[1, 2], M=[1, 2, 4, 8, 16, 32],
            steps=20, warmup=3, rss='spawn', schedules=list(pipeline_step.EXT_VARIANTS))
QUICK = dict(width=256, batch=32, K=[1, 2], M=[1, 4], steps=10, warmup=3,
             rss='fork', schedules=['1f1b'])


# --- torch baselines (bench/torch_baselines.py, in the torch venv) ------------


# The torch python: --torch_python, else .venv-torch's when it exists.
TorchPython = torch_common.TorchPython


def SavePlainWeights(step: 'pipeline_step.Step', path: str) -> None:
  """The plain model's current weights as w<i> [in, out], b<i> [out]."""
  arrays = {}
  for v, value in zip(step.variables, step.sess.run(step.variables)):
    # SequentialLayer names its layers cell_000, cell_001, ...
    match = re.search(r'(\d+)/(w|b)(/var)?$', v.op.name)
    if not match:
      raise ValueError('Unexpected variable %s in the plain model.' %
                       v.op.name)
    arrays['%s%d' % (match.group(2), int(match.group(1)))] = value
  if len(arrays) != 2 * pipeline_step.NUM_LAYERS:
    raise ValueError('Expected w and b of %d layers, got %s.' %
                     (pipeline_step.NUM_LAYERS, sorted(arrays)))
  np.savez(path, **arrays)


def TorchRecords(args, plain: 'pipeline_step.Step', plain_loss: float) -> List[Dict]:
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
           '--layers', str(pipeline_step.NUM_LAYERS), '--K'] + [str(k) for k in args.K] + [
               '--M'] + [str(m) for m in args.M] + [
                   '--steps', str(args.steps), '--warmup', str(args.warmup),
                   '--init_npz', npz, '--timeout_s', str(args.torch_timeout_s)]
    pipeline_step.Log('torch baselines: ' + ' '.join(cmd))
    try:
      out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                           timeout=args.torch_timeout_s * (1 + 2 * len(
                               args.K) * len(args.M)))
    except (OSError, subprocess.TimeoutExpired) as e:
      pipeline_step.Log('WARNING torch baselines failed: %r' % e)
      return []
  if out.returncode != 0:
    pipeline_step.Log('WARNING torch baselines failed (exit %d): %s' %
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
      pipeline_step.Log('WARNING ' + msg)
  return records


# --- The sweep ----------------------------------------------------------------


def Pipelines(args) -> List[str]:
  """The pipeline impls of a run: Lingvo's, lingvo_ext's default, variants."""
  return ['lingvo', 'lingvo_ext'] + ['lingvo_ext/' + v for v in args.schedules]


def _TraceConfig(args, steps: Dict[str, pipeline_step.Step], model: str, k: int,
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
    traces[impl] = pipeline_report.TraceStep(steps[impl], args.trace, name, title)
    with open(os.path.join(args.trace, 'summary.jsonl'), 'a') as f:
      f.write(json.dumps(traces[impl]) + '\n')
  return traces


def _ConfigRecords(args, model: str, k: int, m: int,
                   times: Dict[str, List[float]], losses: Dict[str, float],
                   cell_ratio: float, traces: Dict[str, Dict]) -> Dict:
  """The JSON records of one configuration, RSS not yet filled in."""
  plain_loss = losses['plain']
  plain_ms = statistics.median(times['plain']) * 1e3
  ideal = pipeline_step.IdealMs(plain_ms, k, m)
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
        onednn=pipeline_step.OneDnnEnabled(),
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
  recs['lingvo_ext']['ext_params'] = pipeline_step.ExtOnlyParams()
  for impl in recs:
    if impl.startswith('lingvo_ext/'):
      recs[impl]['ext_params'] = dict(
          pipeline_step.ExtOnlyParams(), **{k: repr(v) for k, v in pipeline_step.VariantParams(
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
  rss = pipeline_step.RssMeter(args.rss)
  records = []
  for model in args.models:
    pipeline_step.Log('%s: building the plain model' % model)
    job = dict(model=model, width=args.width, batch=args.batch,
               steps=args.rss_steps, colocate=args.colocate,
               devices=args.devices)
    # The plain model does not depend on K and M: one session and one RSS.
    plain = pipeline_step.Step('plain', model, args.width, args.batch, 1, 1, args.colocate)
    plain_loss = plain.FirstLoss()
    if model == 'homogeneous' and args.torch_python:
      for r in TorchRecords(args, plain, plain_loss):
        _Emit(args, records, r)
    plain_rss = rss.Measure(dict(job, impl='plain', K=1, M=1))
    for k in args.K:
      cell_ratio = pipeline_step.SlowestToMean(
          pipeline_step.CellFlops(pipeline_step.Cells(model, args.width, args.batch, k,
                          per_example_loss=True), model, args.width,
                    args.batch))
      for m in args.M:
        t_cfg = time.time()
        steps = {'plain': plain}
        losses = {'plain': plain_loss}
        for impl in Pipelines(args):
          steps[impl] = pipeline_step.Step(impl, model, args.width, args.batch, k, m,
                             args.colocate, num_devices=args.devices)
          losses[impl] = steps[impl].FirstLoss()
        bad = {i: l for i, l in losses.items()
               if abs(l - plain_loss) > LOSS_RTOL * abs(plain_loss)}
        if bad:
          msg = '%s K=%d M=%d: first-step losses differ: %s' % (model, k, m,
                                                                losses)
          if args.check:
            raise AssertionError(msg)
          pipeline_step.Log('WARNING ' + msg)
        times = pipeline_step.TimeRoundRobin(steps, args.steps, args.warmup)
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
        pipeline_step.Log('%s K=%d M=%d: %s (%.0f s)' % (
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
  machine = dict(onednn=pipeline_step.OneDnnEnabled(),
                 cpu_bf16_units=precision.CpuHasBf16Units())
  for model in args.models:
    for k in args.K:
      for m in args.M:
        steps, losses = {}, {}
        for impl in impls:
          for dtype in args.dtype:
            key = (impl, dtype)
            steps[key] = pipeline_step.Step(impl, model, args.width, args.batch, k, m,
                              args.colocate, dtype=dtype,
                              num_devices=args.devices)
            losses[key] = steps[key].FirstLoss()
        times = pipeline_step.TimeRoundRobin(steps, args.steps, args.warmup)
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
        pipeline_step.Log('%s K=%d M=%d: %s' % (model, k, m, ', '.join(
            '%s %s %.1f ms' % (i, d, r['step_ms'])
            for (i, d), r in recs.items())))
  return records


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
      '--models', nargs='+', choices=pipeline_step.MODELS + ('transformer',),
      default=list(pipeline_step.MODELS),
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
      pipeline_step.VariantParams(v)
    except ValueError as e:
      parser.error('--schedules: %s' % e)
  for m in args.M:
    if args.batch % m:
      parser.error('--batch %d is not divisible by M=%d.' % (args.batch, m))
  if torch_common.BadTorchPython(args.torch_python):
    parser.error(torch_common.BadTorchPython(args.torch_python))
  if not args._child:  # pylint: disable=protected-access
    args.torch_python, note = TorchPython(args.torch_python)
    if {'homogeneous', 'transformer'} & set(args.models):
      pipeline_step.Log(note)
  return args


def main(argv=None) -> int:
  args = ParseArgs(argv)
  child = args._child  # pylint: disable=protected-access
  if child:
    print(json.dumps(pipeline_step.ChildPeakRss(json.loads(child))))
    return 0
  pipeline_step.PinThreadPools()
  if args.from_jsonl:
    with open(args.from_jsonl) as f:
      records = [json.loads(l) for l in f if l.strip()]
    pipeline_report.PrintMarkdown(records)
    return 0
  if 'transformer' in args.models:
    if len(args.models) > 1:
      pipeline_step.Log("--models transformer runs on its own; give it alone.")
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
    records = torch_common.WithTransformerRecords(
        records, args.torch_python, args.transformer_layers, pairs, steps)
    if args.markdown:
      print(transformer_report.Markdown(records))
      if len(args.dtype) > 1:
        print()
        print(transformer_report.MarkdownDtypes(records))
    else:
      for r in records:
        print(json.dumps(r))
    return 0
  t = time.time()
  if args.dtype != ['float32']:
    records = RunDtypes(args)
    if args.markdown:
      print(pipeline_report.MarkdownDtypes(records))
    pipeline_step.Log('done in %.0f s' % (time.time() - t))
    return 0
  records = RunSweep(args)
  if args.markdown:
    pipeline_report.PrintMarkdown(records)
  pipeline_step.Log('done in %.0f s' % (time.time() - t))
  if args.trace:
    pipeline_step.Log('traces: wrote *.trace.json (chrome://tracing), *.host_trace.json, '
         '*.png (Gantt charts) and summary.jsonl to %s' %
         os.path.abspath(args.trace))
  return 0


if __name__ == '__main__':
  sys.exit(main())
