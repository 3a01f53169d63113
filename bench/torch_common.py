"""What the torch baselines share with bench/pipeline.py and
bench/transformer.py, without torch: the records and their markdown, the
jobs and their threads, the models' numpy data and initial weights, the
torch python to run (bench/torch_baselines.py runs the torch side).

Only the standard library and numpy are imported.
"""

import itertools
import json
import os
import statistics
import subprocess
import sys
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SCHEDULES = ('gpipe', '1f1b')


IMPL_PREFIX = 'torch/'


# bench/transformer.py's sizes (T, D, HIDDEN, HEADS, VOCAB there).
TRANSFORMER = dict(time_steps=16, model_dim=64, hidden=128, heads=2, vocab=32)


# The torch baselines' python when --torch_python is not given.
VENV_PYTHON = os.path.join(_REPO, '.venv-torch', 'bin', 'python')


def Log(msg: str) -> None:
  print('[torch_baselines] ' + msg, file=sys.stderr, flush=True)


def TorchPython(flag: Optional[str],
                default: str = VENV_PYTHON) -> Tuple[Optional[str], str]:
  """(the python to run the torch baselines with or None, a note why)."""
  if flag == 'none':
    return None, 'torch baselines off (--torch_python none).'
  if flag:
    return flag, 'torch baselines: %s' % flag
  if os.access(default, os.X_OK):
    return default, 'torch baselines: %s' % default
  return None, ('torch baselines skipped: no %s (make it with `bash '
                'scripts/torch_venv.sh`, or pass --torch_python PATH).' %
                os.path.relpath(default, _REPO))


def BadTorchPython(flag: Optional[str]) -> Optional[str]:
  """The one-line error for a --torch_python that cannot run, else None."""
  if flag and flag != 'none' and not os.access(flag, os.X_OK):
    return ('--torch_python %s is not an executable; give a python that has '
            'torch (bash scripts/torch_venv.sh makes .venv-torch/bin/python) '
            'or "none".' % flag)
  return None


def Jobs(args) -> List[Dict]:
  """The (impl, K, M) jobs of a run, with notes for the skipped ones."""
  jobs = []
  if not args.no_plain:
    jobs.append(dict(impl=IMPL_PREFIX + 'plain', K=1, M=1))
    if getattr(args, 'bf16_autocast', False):
      jobs.append(dict(impl=IMPL_PREFIX + 'plain', K=1, M=1, autocast=True))
  for k in args.K:
    if k < 2:
      continue  # One stage is the plain model.
    for m in args.M:
      for schedule in args.schedules:
        job = dict(impl=IMPL_PREFIX + schedule, K=k, M=m)
        if schedule == '1f1b' and m < k:
          job['skip'] = 'Schedule1F1B needs M >= K'
        jobs.append(job)
  return jobs


def TransformerDims(args) -> Dict:
  """TRANSFORMER with the sizes given on the command line."""
  return {name: (getattr(args, name, None) or value)
          for name, value in TRANSFORMER.items()}


def Threads(total: int, num_processes: int) -> int:
  """Each process's share of `total` cores (at least 1)."""
  return max(1, total // num_processes)


def TransformerSplits(num_layers: int, k: int) -> List[int]:
  """Each stage's last encoder layer (exclusive), as GPipeTransformerStack's
  `splits=K` (ceil(L / K) layers per stage, the rest in the last)."""
  per_stage = (num_layers - 1) // k + 1
  return [min((i + 1) * per_stage, num_layers) for i in range(k - 1)] + [
      num_layers]


def Sum(values: Sequence[Optional[float]]) -> Optional[float]:
  if any(v is None for v in values):
    return None
  return round(sum(values), 1)


def Record(job: Dict, args, times_s: Sequence[float], first_loss: float,
           rss_mb: Sequence[Optional[float]],
           base_rss_mb: Sequence[Optional[float]], torch_info: Dict,
           first_step_s: Optional[float] = None) -> Dict:
  """One job's record; transformer records also carry bench/transformer.py's
  keys (variant, L, ops, first_step_s, peak_rss_mb)."""
  ms = [1e3 * t for t in times_s]
  rec = dict(
      impl=job['impl'], framework='torch', model=args.model, K=job['K'],
      M=job['M'], step_ms=round(statistics.median(ms), 3),
      p25_ms=round(float(np.percentile(ms, 25)), 3),
      p75_ms=round(float(np.percentile(ms, 75)), 3), steps=len(ms),
      width=args.width, batch=args.batch, layers=args.layers,
      processes=len(rss_mb), threads_per_process=job['threads'],
      first_loss=first_loss,
      first_step_s=None if first_step_s is None else round(first_step_s, 2),
      peak_rss_mb=Sum(rss_mb), base_rss_mb=Sum(base_rss_mb),
      rss_per_process_mb=[None if r is None else round(r, 1) for r in rss_mb],
      **torch_info)
  if args.model == 'transformer':
    # The pipelines apply loss_fn per micro-batch in the last stage:
    # bench/transformer.py's --loss last_cell, never a recompute.
    rec.update(variant=job['impl'], L=args.layers, ops=None,
               loss='after' if job['impl'] == IMPL_PREFIX + 'plain'
               else 'last_cell',
               dtype='bfloat16' if job.get('autocast') else 'float32',
               **job.get('dims', TRANSFORMER))
  return rec


def AddRatios(records: List[Dict]) -> None:
  """vs_torch_plain on every torch record, where torch/plain was run."""
  plain = {r['model']: r for r in records
           if r['impl'] == IMPL_PREFIX + 'plain'
           and r.get('dtype', 'float32') == 'float32'}
  for r in records:
    if r['impl'].startswith(IMPL_PREFIX) and r['model'] in plain:
      r['vs_torch_plain'] = round(
          r['step_ms'] / plain[r['model']]['step_ms'], 4)


def Markdown(records: Sequence[Dict]) -> str:
  """One row per torch record."""

  def _F(x, fmt='%.1f'):
    return '-' if x is None else fmt % x

  lines = ['| impl | K | M | processes x threads | ms (p25-p75) '
           '| x torch plain | first step s | first loss | vs TF plain loss '
           '| peak RSS MB (base) |',
           '|' + '---|' * 10]
  for r in records:
    if not r['impl'].startswith(IMPL_PREFIX):
      continue
    lines.append('| %s | %d | %d | %d x %d | %s (%s-%s) | %s | %s | %.6g | %s '
                 '| %s (%s) |' % (
                     r['impl'] + (' (bf16 autocast)' if r.get('dtype') ==
                                  'bfloat16' else ''),
                     r['K'], r['M'], r['processes'],
                     r['threads_per_process'], _F(r['step_ms']),
                     _F(r['p25_ms']), _F(r['p75_ms']),
                     _F(r.get('vs_torch_plain'), '%.2f'),
                     _F(r.get('first_step_s'), '%.2f'), r['first_loss'],
                     _F(r.get('loss_rel_diff'), '%.1e'),
                     _F(r['peak_rss_mb'], '%.0f'),
                     _F(r.get('base_rss_mb'), '%.0f')))
  return '\n'.join(lines)


def TransformerRecords(torch_python: str, num_layers: Sequence[int],
                       km_pairs: Sequence[Tuple[int, int]], steps: int,
                       timeout_s: int = 600, dims: Optional[Dict] = None,
                       bf16_autocast: bool = False) -> List[Dict]:
  """Runs this file's transformer model with `torch_python`, per (L, K, M).

  `dims`: TRANSFORMER's keys (sizes; its values by default) and 'batch'.
  `bf16_autocast`: torch/plain also in bf16 autocast.

  Returns records in bench/transformer.py's format (variant 'torch/plain',
  'torch/gpipe', 'torch/1f1b'; torch/plain under each (L, K, M) it was timed
  beside), or one error record per configuration that failed.
  """
  records = []
  for l, (k, m) in itertools.product(num_layers, km_pairs):
    cmd = [torch_python, os.path.abspath(__file__), '--model', 'transformer',
           '--layers', str(l), '--K', str(k), '--M', str(m), '--steps',
           str(steps), '--timeout_s', str(timeout_s)]
    for name, value in sorted((dims or {}).items()):
      if name != 'vocab':
        cmd += ['--' + name, str(value)]
    if bf16_autocast:
      cmd.append('--bf16_autocast')
    Log('torch L=%d K=%d M=%d' % (l, k, m))
    try:
      res = subprocess.run(cmd, capture_output=True, text=True, check=False,
                           timeout=timeout_s * (1 + len(SCHEDULES)))
    except (OSError, subprocess.TimeoutExpired) as e:
      records.append(dict(variant='torch', L=l, K=k, M=m, error=repr(e)))
      continue
    lines = [x for x in res.stdout.splitlines() if x.startswith('{')]
    if res.returncode or not lines:
      tail = res.stderr.strip().splitlines()[-1:] or ['no output']
      records.append(dict(variant='torch', L=l, K=k, M=m,
                          error='exit %d: %s' % (res.returncode, tail[0])))
      continue
    for line in lines:
      rec = json.loads(line)
      # The unpipelined model goes with the configuration it ran beside.
      rec['K'], rec['M'] = k, m
      records.append(rec)
  return records


def MergeByConfig(records: Sequence[Dict],
                  more: Sequence[Dict]) -> List[Dict]:
  """records + more, grouped by (L, K, M, d_model) in the order first seen."""
  order = {}

  def _Key(r):
    return (r['L'], r['K'], r['M'],
            r.get('d_model', r.get('model_dim', TRANSFORMER['model_dim'])))

  for r in list(records) + list(more):
    order.setdefault(_Key(r), len(order))
  return sorted(list(records) + list(more), key=lambda r: order[_Key(r)])


def WithTransformerRecords(records: Sequence[Dict],
                           torch_python: Optional[str],
                           num_layers: Sequence[int],
                           km_pairs: Sequence[Tuple[int, int]],
                           steps: int, dims_list: Sequence[Dict] = (None,),
                           bf16_autocast: bool = False) -> List[Dict]:
  """bench/transformer.py's records with the torch rows of each (L, K, M)
  and sizes beside them; `records` alone when torch_python is None."""
  if not torch_python:
    return list(records)
  more = []
  for dims in dims_list:
    more += TransformerRecords(torch_python, num_layers, km_pairs, steps,
                               dims=dims, bf16_autocast=bf16_autocast)
  return MergeByConfig(records, more)


def RssMb(field: str = 'VmHWM') -> Optional[float]:
  """This process's VmHWM (peak) or another /proc/self/status field, in MB."""
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) / 1024.0
  except OSError:
    pass
  return None


def InitialWeights(width: int, layers: int,
                   init_npz: Optional[str]) -> List[tuple]:
  """[(w [in, out], b [out])] per layer, float32."""
  if init_npz:
    with np.load(init_npz) as f:
      return [(f['w%d' % i].astype(np.float32), f['b%d' % i].astype(np.float32))
              for i in range(layers)]
  return [(np.random.RandomState(i + 1).normal(
      0.0, 1.0 / np.sqrt(width), (width, width)).astype(np.float32),
           np.zeros(width, np.float32)) for i in range(layers)]


def Input(batch: int, width: int) -> np.ndarray:
  """bench/pipeline.py's input."""
  return np.random.RandomState(0).randn(batch, width).astype(np.float32)


def TransformerData(
    batch: int, dims: Optional[Dict] = None) -> Tuple[np.ndarray, np.ndarray]:
  """bench/transformer.py's ids and labels ([time, batch] there), [batch,
  time]."""
  dims = dims or TRANSFORMER
  rng = np.random.RandomState(0)
  shape = [dims['time_steps'], batch]
  ids = rng.randint(0, dims['vocab'], shape)
  labels = rng.randint(0, dims['vocab'], shape)
  return ids.T.astype(np.int64), labels.T.astype(np.int64)


def PositionalEmbedding(length: int, dim: int) -> np.ndarray:
  """Lingvo's PositionalEmbeddingLayer (timescales 1 to 1e4), [length, dim]."""
  num_timescales = dim // 2
  log_increment = np.log(1e4) / max(num_timescales - 1, 1)
  inv_timescales = np.exp(np.arange(num_timescales) * -log_increment)
  scaled_time = np.arange(length)[:, None] * inv_timescales[None, :]
  return np.concatenate([np.sin(scaled_time), np.cos(scaled_time)],
                        axis=1).astype(np.float32)
