"""PyTorch baselines for bench/pipeline.py and bench/transformer.py.

Benchmark only: torch is no requirement of lingvo_ext. Run this file with a
python that has torch and numpy (scripts/torch_venv.sh makes `.venv-torch`);
bench/pipeline.py and bench/transformer.py run it in a subprocess
(`--torch_python`) and add its rows to their own records, so the torch and
TensorFlow figures come from one run.

`--model homogeneous` (the default) is bench/pipeline.py's homogeneous model:
`--layers` FC layers (`nn.Linear` + ReLU) of width `--width`, batch `--batch`,
the input `np.random.RandomState(0).randn(batch, width)`. The last layer is
followed by the per-example loss (sum of squares per example) inside the
model, in the last pipeline stage; a step's loss is the sum over the batch,
then backward and SGD (lr 1e-6), as the TensorFlow step. Weights come from
`--init_npz` (`w<i>` [in, out], `b<i>` [out]: bench/pipeline.py passes its
plain model's initial weights, so the first-step losses must agree) or else
from a numpy Gaussian(1/sqrt(width)) with seed i + 1 and zero biases.

`--model transformer` is bench/transformer.py's model at the same sizes:
token embedding plus Lingvo's sinusoidal position embedding, `--layers`
`nn.TransformerEncoderLayer`s (d_model `--model_dim` 64, dim_feedforward
`--hidden` 128, nhead `--heads` 2, ReLU, dropout 0, batch_first,
norm_first=True, LayerNorm eps 1e-6), a d_model -> 32 softmax layer, the
summed token cross-entropy of `--time_steps` 16 x `--batch` (default 32)
from the same random ids and labels, backward, SGD (lr 1e-4).
`--bf16_autocast` adds torch/plain under `torch.autocast('cpu',
torch.bfloat16)` around the forward pass and loss (records say dtype
'bfloat16'): torch's mixed precision, float32 weights and updates.
Lingvo's default GPipeTransformerLayer is pre-LN too; it differs in that its
attention residual adds the *normalized* input (`add_unnormalized_input`
False: LN(x) + Attn(LN(x)); torch: x + Attn(LN(x))) and its queries have a
learned per-dimension scale (`enable_per_dim_scale`) where torch scales by
1/sqrt(head dim); same weights shapes otherwise, torch's default init (seed
0). Stages split the layers as GPipeTransformerStack's `splits=K` does, the
embedding in the first stage and the softmax in the last.

Implementations (impl names in the records):
  torch/plain   eager, one process, `--threads` intra-op threads (also in
                bf16 autocast with `--bf16_autocast`).
  torch/gpipe   torch.distributed.pipelining.ScheduleGPipe, K stages in K
  torch/1f1b    processes (Schedule1F1B), gloo over 127.0.0.1, each process
                `--threads` // K intra-op threads (its share of the cores);
                sum of per-micro-batch losses (scale_grads=False), each
                micro-batch's loss_fn in the last stage: what
                bench/transformer.py's `--loss last_cell` does (their
                records say loss 'last_cell'); with `--loss after`
                lingvo_ext's '1f1b' recomputes, torch's 1F1B never does.

The step time is the median over `--steps` timed steps after `--warmup`
(pipelines: each step between two barriers, the slowest rank's time). The
time to the first step runs from after `import torch` to the end of the first
step (building the model, the process group for pipelines, the first step;
pipelines: the slowest rank). Peak RSS is each process's VmHWM (pipelines:
summed over the K processes), base RSS its resident set after importing torch,
before the model is built.

  .venv-torch/bin/python bench/torch_baselines.py                # JSON lines
  .venv-torch/bin/python bench/torch_baselines.py --markdown
  .venv-torch/bin/python bench/torch_baselines.py --K 2 --M 4 16 --steps 10
  .venv-torch/bin/python bench/torch_baselines.py --model transformer \
      --layers 32 --K 4 --M 16 --markdown

Only the standard library and numpy are imported at module level; the
record helpers bench/pipeline.py and bench/transformer.py use (without
torch) are bench/torch_common.py's.
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)
from bench import harness  # pylint: disable=g-import-not-at-top,g-bad-import-order
from bench import torch_common  # pylint: disable=g-import-not-at-top,g-bad-import-order

MODELS = ('homogeneous', 'transformer')
# Per model: its defaults and SGD learning rate (bench/pipeline.py's and
# bench/transformer.py's).
DEFAULTS = dict(width=1536, batch=128, layers=8, K=[2], M=[4, 16],
                schedules=list(torch_common.SCHEDULES), threads=2, steps=20, warmup=3)
TRANSFORMER_DEFAULTS = dict(DEFAULTS, width=None, batch=32, K=[2], M=[4])
LEARNING_RATE = {'homogeneous': 1e-6, 'transformer': 1e-4}
TORCH_MISSING = ('torch is not installed for %s; run this file with the '
                 'python of a torch venv (bash scripts/torch_venv.sh makes '
                 '.venv-torch).')


# --- Workers (torch) ----------------------------------------------------------


def _FcModules(job: Dict):
  """This process's FC layers (all of them, or one stage's)."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top

  class PerExampleLoss(nn.Module):
    """Sum of squares per example: the last cell's output, [batch]."""

    def forward(self, y):
      return y.square().sum(dim=1)

  weights = torch_common.InitialWeights(job['width'], job['layers'], job.get('init_npz'))
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


def _TransformerModules(job: Dict):
  """This process's part of the Transformer: all of it, or one stage."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  t = job['dims']

  class Embedding(nn.Module):
    """Token embedding plus Lingvo's sinusoidal positions: [b, T, D]."""

    def __init__(self):
      super().__init__()
      self.emb = nn.Embedding(t['vocab'], t['model_dim'])
      self.register_buffer('pos', torch.from_numpy(torch_common.PositionalEmbedding(
          t['time_steps'], t['model_dim'])))

    def forward(self, ids):
      return self.emb(ids) + self.pos

  # Every process builds the whole model from one seed and keeps its stage,
  # so the pipelines start from torch/plain's weights (the same first loss).
  torch.manual_seed(0)
  layers = [Embedding()] + [
      nn.TransformerEncoderLayer(
          t['model_dim'], t['heads'], dim_feedforward=t['hidden'],
          dropout=0.0, activation='relu', layer_norm_eps=1e-6,
          batch_first=True, norm_first=True)
      for _ in range(job['layers'])] + [
          nn.Linear(t['model_dim'], t['vocab'])]
  k, rank = job['K'], job.get('rank', 0)
  ends = [0] + torch_common.TransformerSplits(job['layers'], k)
  # Layer i + 1 of `layers` is encoder layer i; the embedding goes with the
  # first stage, the softmax with the last.
  lo = 0 if rank == 0 else ends[rank] + 1
  hi = len(layers) if rank == k - 1 else ends[rank + 1] + 1
  return nn.Sequential(*layers[lo:hi])


def _Model(job: Dict):
  """(modules, inputs, target, loss_fn(output, target) -> scalar)."""
  import torch  # pylint: disable=g-import-not-at-top
  if job['model'] == 'transformer':
    ids, labels = torch_common.TransformerData(job['batch'], job['dims'])
    vocab = job['dims']['vocab']

    def Xent(logits, target):
      return torch.nn.functional.cross_entropy(
          logits.reshape(-1, vocab), target.reshape(-1), reduction='sum')

    return (_TransformerModules(job), torch.from_numpy(ids),
            torch.from_numpy(labels), Xent)
  # The FC model's output is already the per-example loss: sum it.
  return (_FcModules(job), torch.from_numpy(torch_common.Input(job['batch'], job['width'])),
          torch.zeros(job['batch']), lambda out, target: out.sum())


def _TimeSteps(step_fn, warmup: int, steps: int, sync=None,
               t0: Optional[float] = None) -> Tuple[List[float], float]:
  """(the timed steps' times, the time from t0 to the end of the first)."""
  first_s = None
  times = []
  for i in range(warmup + steps):
    if sync and i >= warmup:
      sync()
    t = time.perf_counter()
    step_fn()
    if sync and i >= warmup:
      sync()
    if first_s is None:
      first_s = time.perf_counter() - (t if t0 is None else t0)
    if i >= warmup:
      times.append(time.perf_counter() - t)
  return times, first_s


def _TorchInfo() -> Dict:
  import torch  # pylint: disable=g-import-not-at-top
  return dict(torch_version=torch.__version__,
              torch_mkldnn=bool(torch.backends.mkldnn.is_available()))


def RunPlain(job: Dict) -> Dict:
  import torch  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  base = torch_common.RssMb('VmRSS')
  torch.set_num_threads(job['threads'])
  model, x, target, loss_fn = _Model(job)
  opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE[job['model']])
  first_losses = []

  # torch's mixed precision: bf16 matmuls, float32 weights and updates.
  autocast = torch.autocast('cpu', dtype=torch.bfloat16,
                            enabled=bool(job.get('autocast')))

  def Step():
    opt.zero_grad(set_to_none=True)
    with autocast:
      loss = loss_fn(model(x), target)
    loss.backward()
    opt.step()
    if not first_losses:
      first_losses.append(float(loss.detach()))

  times, first_s = _TimeSteps(Step, job['warmup'], job['steps'], t0=t0)
  return dict(times_s=times, first_loss=first_losses[0], first_step_s=first_s,
              rss_mb=torch_common.RssMb(), base_rss_mb=base)


def RunStage(job: Dict) -> Dict:
  """One pipeline stage (rank) of K, in its own process."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top
  from torch.distributed import pipelining  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  base = torch_common.RssMb('VmRSS')
  torch.set_num_threads(job['threads'])
  k, rank = job['K'], job['rank']
  timeout = datetime.timedelta(seconds=job['timeout_s'])
  store = dist.TCPStore('127.0.0.1', job['port'], is_master=False,
                        timeout=timeout)
  dist.init_process_group('gloo', store=store, rank=rank, world_size=k,
                          timeout=timeout)
  try:
    stage_mod, x, target, loss_fn = _Model(job)
    stage = pipelining.PipelineStage(stage_mod, rank, k, torch.device('cpu'))
    cls = {'gpipe': pipelining.ScheduleGPipe,
           '1f1b': pipelining.Schedule1F1B}[job['impl'][len(torch_common.IMPL_PREFIX):]]
    # Sum (not average) over micro-batches, as the TensorFlow step does.
    schedule = cls(stage, n_microbatches=job['M'], loss_fn=loss_fn,
                   scale_grads=False)
    opt = torch.optim.SGD(stage_mod.parameters(),
                          lr=LEARNING_RATE[job['model']])
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

    times, first_s = _TimeSteps(Step, job['warmup'], job['steps'],
                                sync=dist.barrier, t0=t0)
    return dict(times_s=times,
                first_loss=first_losses[0] if first_losses else None,
                first_step_s=first_s, rss_mb=torch_common.RssMb(), base_rss_mb=base)
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
  num_procs = 1 if job['impl'] == torch_common.IMPL_PREFIX + 'plain' else k
  job = dict(job, model=args.model, width=args.width, batch=args.batch,
             layers=args.layers, steps=args.steps, warmup=args.warmup,
             init_npz=args.init_npz, dims=torch_common.TransformerDims(args),
             threads=(args.threads if num_procs == 1 else
                      torch_common.Threads(args.threads, num_procs)),
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
  return torch_common.Record(job, args, times, first_loss, [r['rss_mb'] for r in results],
                [r['base_rss_mb'] for r in results], torch_info,
                max(r['first_step_s'] for r in results))


def ParseArgs(argv=None):
  parser = harness.Parser(__doc__, raw=True)
  parser.epilog = '\n'.join(__doc__.splitlines()[1:])
  d = DEFAULTS
  parser.add_argument('--model', choices=MODELS, default=MODELS[0],
                      help='bench/pipeline.py\'s FC model (default) or '
                      'bench/transformer.py\'s Transformer.')
  parser.add_argument('--width', type=int,
                      help='FC width (default %d; homogeneous only).' %
                      d['width'])
  parser.add_argument('--batch', type=int,
                      help='Default %d (homogeneous), %d (transformer).' %
                      (d['batch'], TRANSFORMER_DEFAULTS['batch']))
  parser.add_argument('--layers', type=int,
                      help='FC or encoder layers (default %d).' % d['layers'])
  parser.add_argument('--K', type=int, nargs='+',
                      help='Pipeline stages = processes (K < 2 skipped: the '
                      'plain model is the one-stage case; default %s, '
                      'transformer %s).' % (d['K'], TRANSFORMER_DEFAULTS['K']))
  parser.add_argument('--M', type=int, nargs='+',
                      help='Micro-batches (default %s, transformer %s).' %
                      (d['M'], TRANSFORMER_DEFAULTS['M']))
  parser.add_argument('--schedules', nargs='*', choices=torch_common.SCHEDULES,
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
                      help='Initial weights w<i> [in, out], b<i> [out] '
                      '(homogeneous only).')
  parser.add_argument('--timeout_s', type=int, default=600,
                      help='Bound on each job and each collective wait.')
  for name, value in torch_common.TRANSFORMER.items():
    if name != 'vocab':
      parser.add_argument('--' + name, type=int,
                          help='Transformer only (default %d).' % value)
  parser.add_argument('--bf16_autocast', action='store_true',
                      help='Transformer only: torch/plain also in bf16 '
                      'autocast.')
  parser.add_argument('--_worker', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args._worker:  # pylint: disable=protected-access
    return args
  transformer = args.model == 'transformer'
  if transformer:
    for name in ('width', 'init_npz'):
      if getattr(args, name) is not None:
        parser.error('--%s is for --model homogeneous; drop it for the '
                     'transformer.' % name)
    for name in torch_common.TRANSFORMER:
      value = getattr(args, name, None)
      if value is not None and value < 1:
        parser.error('--%s must be >= 1.' % name)
    dims = torch_common.TransformerDims(args)
    if dims['model_dim'] % dims['heads']:
      parser.error('--model_dim %d is not divisible by --heads %d; pick '
                   'heads that divide it.' % (dims['model_dim'], dims['heads']))
  else:
    for name in list(torch_common.TRANSFORMER) + ['bf16_autocast']:
      if getattr(args, name, None):
        parser.error('--%s is for --model transformer; drop it.' % name)
  for name, value in (TRANSFORMER_DEFAULTS if transformer else d).items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  for name in ('batch', 'layers', 'threads', 'steps', 'timeout_s') + (
      () if transformer else ('width',)):
    if getattr(args, name) < 1:
      parser.error('--%s must be >= 1.' % name)
  if args.warmup < 0:
    parser.error('--warmup must be >= 0.')
  for k in args.K:
    if transformer and k > args.layers:
      parser.error('--K %d is more stages than --layers %d; use K <= layers.' %
                   (k, args.layers))
    if not transformer and k >= 2 and args.layers % k:
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
    import torch  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    print(TORCH_MISSING % sys.executable, file=sys.stderr)
    return 2
  worker = args._worker  # pylint: disable=protected-access
  if worker:
    job = json.loads(worker)
    run = RunPlain if job['impl'] == torch_common.IMPL_PREFIX + 'plain' else RunStage
    print(json.dumps(run(job)), flush=True)
    return 0
  torch_info = _TorchInfo()
  records = []
  for job in torch_common.Jobs(args):
    if job.get('skip'):
      torch_common.Log('%s K=%d M=%d skipped: %s' % (job['impl'], job['K'], job['M'],
                                         job['skip']))
      continue
    t = time.time()
    rec = RunJob(job, args, torch_info)
    torch_common.Log('%s K=%d M=%d: %.1f ms (%.0f s)' % (rec['impl'], rec['K'], rec['M'],
                                            rec['step_ms'], time.time() - t))
    records.append(rec)
  torch_common.AddRatios(records)
  if args.markdown:
    print(torch_common.Markdown(records))
  else:
    for r in records:
      print(json.dumps(r), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
