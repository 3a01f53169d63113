"""PyTorch baselines for bench/pipeline.py: the same FC model in torch.

Benchmark only: torch is no requirement of lingvo_ext. Run this file with a
python that has torch and numpy (scripts/torch_venv.sh makes `.venv-torch`);
bench/pipeline.py runs it in a subprocess (`--torch_python`) and adds its rows
to its own records, so the torch and TensorFlow figures come from one run.

The model is bench/pipeline.py's homogeneous model: `--layers` FC layers
(`nn.Linear` + ReLU) of width `--width`, batch `--batch`, the input
`np.random.RandomState(0).randn(batch, width)`. The last layer is followed by
the per-example loss (sum of squares per example) inside the model, in the
last pipeline stage; a step's loss is the sum over the batch, then backward
and SGD (lr 1e-6), as the TensorFlow step. Weights come from `--init_npz`
(`w<i>` [in, out], `b<i>` [out]: bench/pipeline.py passes its plain model's
initial weights, so the first-step losses must agree) or else from a numpy
Gaussian(1/sqrt(width)) with seed i + 1 and zero biases.

Implementations (impl names in the records):
  torch/plain   eager, one process, `--threads` intra-op threads.
  torch/gpipe   torch.distributed.pipelining.ScheduleGPipe, K stages in K
  torch/1f1b    processes (Schedule1F1B), gloo over 127.0.0.1, each process
                `--threads` // K intra-op threads (its share of the cores);
                sum of per-micro-batch losses (scale_grads=False).

The step time is the median over `--steps` timed steps after `--warmup`
(pipelines: each step between two barriers, the slowest rank's time). Peak RSS
is each process's VmHWM (pipelines: summed over the K processes), base RSS its
resident set after importing torch, before the model is built.

  .venv-torch/bin/python bench/torch_baselines.py                # JSON lines
  .venv-torch/bin/python bench/torch_baselines.py --markdown
  .venv-torch/bin/python bench/torch_baselines.py --K 2 --M 4 16 --steps 10

Only the standard library and numpy are imported at module level, so
bench/pipeline.py (without torch) can use the record helpers here.
"""

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

SCHEDULES = ('gpipe', '1f1b')
IMPL_PREFIX = 'torch/'
LEARNING_RATE = 1e-6
DEFAULTS = dict(width=1536, batch=128, layers=8, K=[2], M=[4, 16],
                schedules=list(SCHEDULES), threads=2, steps=20, warmup=3)
TORCH_MISSING = ('torch is not installed for %s; run this file with the '
                 'python of a torch venv (bash scripts/torch_venv.sh makes '
                 '.venv-torch).')


def _Log(msg: str) -> None:
  print('[torch_baselines] ' + msg, file=sys.stderr, flush=True)


# --- What to run --------------------------------------------------------------


def Jobs(args) -> List[Dict]:
  """The (impl, K, M) jobs of a run, with notes for the skipped ones."""
  jobs = []
  if not args.no_plain:
    jobs.append(dict(impl=IMPL_PREFIX + 'plain', K=1, M=1))
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


def Threads(total: int, num_processes: int) -> int:
  """Each process's share of `total` cores (at least 1)."""
  return max(1, total // num_processes)


# --- Records (no torch needed) ------------------------------------------------


def _Sum(values: Sequence[Optional[float]]) -> Optional[float]:
  if any(v is None for v in values):
    return None
  return round(sum(values), 1)


def Record(job: Dict, args, times_s: Sequence[float], first_loss: float,
           rss_mb: Sequence[Optional[float]],
           base_rss_mb: Sequence[Optional[float]], torch_info: Dict) -> Dict:
  ms = [1e3 * t for t in times_s]
  return dict(
      impl=job['impl'], framework='torch', model='homogeneous', K=job['K'],
      M=job['M'], step_ms=round(statistics.median(ms), 3),
      p25_ms=round(float(np.percentile(ms, 25)), 3),
      p75_ms=round(float(np.percentile(ms, 75)), 3), steps=len(ms),
      width=args.width, batch=args.batch, layers=args.layers,
      processes=len(rss_mb), threads_per_process=job['threads'],
      first_loss=first_loss,
      peak_rss_mb=_Sum(rss_mb), base_rss_mb=_Sum(base_rss_mb),
      rss_per_process_mb=[None if r is None else round(r, 1) for r in rss_mb],
      **torch_info)


def AddRatios(records: List[Dict]) -> None:
  """vs_torch_plain on every torch record, where torch/plain was run."""
  plain = {r['model']: r for r in records
           if r['impl'] == IMPL_PREFIX + 'plain'}
  for r in records:
    if r['impl'].startswith(IMPL_PREFIX) and r['model'] in plain:
      r['vs_torch_plain'] = round(
          r['step_ms'] / plain[r['model']]['step_ms'], 4)


def Markdown(records: Sequence[Dict]) -> str:
  """One row per torch record."""

  def _F(x, fmt='%.1f'):
    return '-' if x is None else fmt % x

  lines = ['| impl | K | M | processes x threads | ms (p25-p75) '
           '| x torch plain | first loss | vs TF plain loss | peak RSS MB '
           '(base) |',
           '|' + '---|' * 9]
  for r in records:
    if not r['impl'].startswith(IMPL_PREFIX):
      continue
    lines.append('| %s | %d | %d | %d x %d | %s (%s-%s) | %s | %.6g | %s '
                 '| %s (%s) |' % (
                     r['impl'], r['K'], r['M'], r['processes'],
                     r['threads_per_process'], _F(r['step_ms']),
                     _F(r['p25_ms']), _F(r['p75_ms']),
                     _F(r.get('vs_torch_plain'), '%.2f'), r['first_loss'],
                     _F(r.get('loss_rel_diff'), '%.1e'),
                     _F(r['peak_rss_mb'], '%.0f'),
                     _F(r.get('base_rss_mb'), '%.0f')))
  return '\n'.join(lines)


# --- Workers (torch) ----------------------------------------------------------


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


def _Modules(job: Dict):
  """This process's layers (all of them, or one stage's) as nn.Sequential."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top

  class PerExampleLoss(nn.Module):
    """Sum of squares per example: the last cell's output, [batch]."""

    def forward(self, y):
      return y.square().sum(dim=1)

  weights = InitialWeights(job['width'], job['layers'], job.get('init_npz'))
  k, rank = job['K'], job.get('rank', 0)
  per_stage = job['layers'] // k
  mods = []
  for w, b in weights[rank * per_stage:(rank + 1) * per_stage]:
    lin = nn.Linear(w.shape[0], w.shape[1])
    with torch.no_grad():
      lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
      lin.bias.copy_(torch.from_numpy(b))
    mods += [lin, nn.ReLU()]
  if rank == k - 1:
    mods.append(PerExampleLoss())
  return nn.Sequential(*mods)


def _TimeSteps(step_fn, warmup: int, steps: int, sync=None) -> List[float]:
  for _ in range(warmup):
    step_fn()
  times = []
  for _ in range(steps):
    if sync:
      sync()
    t = time.perf_counter()
    step_fn()
    if sync:
      sync()
    times.append(time.perf_counter() - t)
  return times


def _TorchInfo() -> Dict:
  import torch  # pylint: disable=g-import-not-at-top
  return dict(torch_version=torch.__version__,
              torch_mkldnn=bool(torch.backends.mkldnn.is_available()))


def RunPlain(job: Dict) -> Dict:
  import torch  # pylint: disable=g-import-not-at-top
  base = RssMb('VmRSS')
  torch.set_num_threads(job['threads'])
  model = _Modules(job)
  x = torch.from_numpy(Input(job['batch'], job['width']))
  opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
  with torch.no_grad():
    first_loss = float(model(x).sum())

  def Step():
    opt.zero_grad(set_to_none=True)
    model(x).sum().backward()
    opt.step()

  times = _TimeSteps(Step, job['warmup'], job['steps'])
  return dict(times_s=times, first_loss=first_loss, rss_mb=RssMb(),
              base_rss_mb=base)


def RunStage(job: Dict) -> Dict:
  """One pipeline stage (rank) of K, in its own process."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top
  from torch.distributed import pipelining  # pylint: disable=g-import-not-at-top
  base = RssMb('VmRSS')
  torch.set_num_threads(job['threads'])
  k, rank = job['K'], job['rank']
  timeout = datetime.timedelta(seconds=job['timeout_s'])
  store = dist.TCPStore('127.0.0.1', job['port'], is_master=False,
                        timeout=timeout)
  dist.init_process_group('gloo', store=store, rank=rank, world_size=k,
                          timeout=timeout)
  try:
    stage_mod = _Modules(job)
    stage = pipelining.PipelineStage(stage_mod, rank, k, torch.device('cpu'))
    cls = {'gpipe': pipelining.ScheduleGPipe,
           '1f1b': pipelining.Schedule1F1B}[job['impl'][len(IMPL_PREFIX):]]
    # The stage's output is already the per-example loss: sum it, and sum
    # (not average) over micro-batches, as the TensorFlow step does.
    schedule = cls(stage, n_microbatches=job['M'],
                   loss_fn=lambda out, target: out.sum(), scale_grads=False)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=LEARNING_RATE)
    x = torch.from_numpy(Input(job['batch'], job['width']))
    target = torch.zeros(job['batch'])
    first_losses = []

    def Step():
      opt.zero_grad(set_to_none=True)
      losses = []
      if rank == 0:
        schedule.step(x, return_outputs=False)
      elif rank == k - 1:
        schedule.step(target=target, losses=losses, return_outputs=False)
      else:
        schedule.step(return_outputs=False)
      opt.step()
      if losses and not first_losses:
        first_losses.append(float(sum(l.detach() for l in losses)))

    times = _TimeSteps(Step, job['warmup'], job['steps'], sync=dist.barrier)
    return dict(times_s=times,
                first_loss=first_losses[0] if first_losses else None,
                rss_mb=RssMb(), base_rss_mb=base)
  finally:
    dist.destroy_process_group()


# --- The parent: processes, bounded waits -------------------------------------


def _Launch(job: Dict, out_path: str, err_path: str) -> subprocess.Popen:
  env = dict(os.environ, OMP_NUM_THREADS=str(job['threads']),
             MKL_NUM_THREADS=str(job['threads']), GLOO_SOCKET_IFNAME='lo',
             MASTER_ADDR='127.0.0.1')
  with open(out_path, 'w') as out, open(err_path, 'w') as err:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), '--_worker',
         json.dumps(job)], stdout=out, stderr=err, env=env,
        start_new_session=True)


def _Kill(procs: Sequence[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for p in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass


def RunJob(job: Dict, args, torch_info: Dict) -> Dict:
  """Runs one job in fresh processes (K for a pipeline); its record."""
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top
  k = job['K']
  num_procs = 1 if job['impl'] == IMPL_PREFIX + 'plain' else k
  job = dict(job, width=args.width, batch=args.batch, layers=args.layers,
             steps=args.steps, warmup=args.warmup, init_npz=args.init_npz,
             threads=(args.threads if num_procs == 1 else
                      Threads(args.threads, num_procs)),
             timeout_s=args.timeout_s)
  store = None
  if num_procs > 1:
    # The rendezvous store lives here, on a free port the OS picked.
    store = dist.TCPStore('127.0.0.1', 0, is_master=True,
                          wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout_s))
    job['port'] = store.port
  procs = []
  with tempfile.TemporaryDirectory(prefix='torch_baselines_') as tmp:
    try:
      for rank in range(num_procs):
        procs.append(_Launch(dict(job, rank=rank),
                             os.path.join(tmp, '%d.out' % rank),
                             os.path.join(tmp, '%d.err' % rank)))
      deadline = time.time() + args.timeout_s
      results = []
      for rank, p in enumerate(procs):
        try:
          rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
          raise RuntimeError('%s K=%d M=%d: rank %d still running after '
                             '--timeout_s %d s' % (job['impl'], k, job['M'],
                                                   rank, args.timeout_s))
        if rc != 0:
          with open(os.path.join(tmp, '%d.err' % rank)) as f:
            err = f.read()[-3000:]
          raise RuntimeError('%s K=%d M=%d: rank %d exited %d:\n%s' %
                             (job['impl'], k, job['M'], rank, rc, err))
        with open(os.path.join(tmp, '%d.out' % rank)) as f:
          results.append(json.loads(f.read().strip().splitlines()[-1]))
    finally:
      _Kill(procs)
      del store
  # Each step took as long as its slowest rank.
  times = [max(ts) for ts in zip(*[r['times_s'] for r in results])]
  first_loss = [r['first_loss'] for r in results
                if r['first_loss'] is not None][0]
  return Record(job, args, times, first_loss, [r['rss_mb'] for r in results],
                [r['base_rss_mb'] for r in results], torch_info)


def ParseArgs(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='\n'.join(__doc__.splitlines()[1:]))
  d = DEFAULTS
  parser.add_argument('--width', type=int, default=d['width'])
  parser.add_argument('--batch', type=int, default=d['batch'])
  parser.add_argument('--layers', type=int, default=d['layers'],
                      help='FC layers (default %(default)s).')
  parser.add_argument('--K', type=int, nargs='+', default=d['K'],
                      help='Pipeline stages = processes (K < 2 skipped: the '
                      'plain model is the one-stage case).')
  parser.add_argument('--M', type=int, nargs='+', default=d['M'],
                      help='Micro-batches.')
  parser.add_argument('--schedules', nargs='*', choices=SCHEDULES,
                      default=d['schedules'])
  parser.add_argument('--no_plain', action='store_true',
                      help='Do not run torch/plain.')
  parser.add_argument('--threads', type=int, default=d['threads'],
                      help='Cores in all: torch/plain gets this many intra-op '
                      'threads, each of K stage processes threads // K '
                      '(default %(default)s, as TensorFlow\'s 2 inter-op '
                      'threads in bench/pipeline.py).')
  parser.add_argument('--steps', type=int, default=d['steps'])
  parser.add_argument('--warmup', type=int, default=d['warmup'])
  parser.add_argument('--init_npz',
                      help='Initial weights w<i> [in, out], b<i> [out].')
  parser.add_argument('--timeout_s', type=int, default=600,
                      help='Bound on each job and each collective wait.')
  parser.add_argument('--markdown', action='store_true',
                      help='Print a markdown table instead of JSON lines.')
  parser.add_argument('--_worker', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args._worker:  # pylint: disable=protected-access
    return args
  for name in ('width', 'batch', 'layers', 'threads', 'steps', 'timeout_s'):
    if getattr(args, name) < 1:
      parser.error('--%s must be >= 1.' % name)
  if args.warmup < 0:
    parser.error('--warmup must be >= 0.')
  for k in args.K:
    if k >= 2 and args.layers % k:
      parser.error('--K %d does not divide --layers %d; use a K that does.' %
                   (k, args.layers))
  for m in args.M:
    if m < 1 or args.batch % m:
      parser.error('--batch %d is not divisible by M=%d; pick --M that divide '
                   'it.' % (args.batch, m))
  if args.init_npz and not os.path.exists(args.init_npz):
    parser.error('--init_npz %s does not exist.' % args.init_npz)
  return args


def main(argv=None) -> int:
  args = ParseArgs(argv)
  try:
    import torch  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    print(TORCH_MISSING % sys.executable, file=sys.stderr)
    return 2
  worker = args._worker  # pylint: disable=protected-access
  if worker:
    job = json.loads(worker)
    run = RunPlain if job['impl'] == IMPL_PREFIX + 'plain' else RunStage
    print(json.dumps(run(job)), flush=True)
    return 0
  torch_info = _TorchInfo()
  records = []
  for job in Jobs(args):
    if job.get('skip'):
      _Log('%s K=%d M=%d skipped: %s' % (job['impl'], job['K'], job['M'],
                                         job['skip']))
      continue
    t = time.time()
    rec = RunJob(job, args, torch_info)
    _Log('%s K=%d M=%d: %.1f ms (%.0f s)' % (rec['impl'], rec['K'], rec['M'],
                                            rec['step_ms'], time.time() - t))
    records.append(rec)
  AddRatios(records)
  if args.markdown:
    print(Markdown(records))
  else:
    for r in records:
      print(json.dumps(r), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
