r"""Trains on a local multi-process TensorFlow cluster on 127.0.0.1.

  python -m lingvo_ext.launch --model=lm.TransformerLmTinyGPipe \
      --logdir=/tmp/lm_cluster --workers=2 --worker_split_size=2

starts a controller, a trainer client and --workers worker processes of
`lingvo_ext.trainer` with a matching --cluster_spec, streams their logs
prefixed by task, restarts a task that dies (training resumes from the last
checkpoint), and stops them all when training ends or on Ctrl-C. Every flag
other than the launcher's own (below) goes to every trainer process, e.g.
--max_steps=100. With one CPU device per worker (--num_cpu_devices=1),
replica r's cell i runs on worker task r*K+i (K = --worker_split_size), so
--workers=4 --worker_split_size=2 trains 2 replicas of a 2-cell pipeline.
See lingvo_ext/distributed/launch_lib.py and README "Running on several
machines".
"""

import argparse
import sys

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import launch_lib


def _Parser():
  p = argparse.ArgumentParser(
      prog='python -m lingvo_ext.launch',
      description='Local multi-process training cluster; other flags go to '
      'every lingvo_ext.trainer process.')
  p.add_argument('--workers', type=int, required=True,
                 help='Worker processes (one replica needs '
                 '--worker_split_size of them).')
  p.add_argument('--network', choices=('private', 'host'), default='private',
                 help='private: run the cluster in a network namespace with '
                 'only loopback (nothing outside can connect); host: the '
                 'host\'s network (TensorFlow listens on all interfaces).')
  p.add_argument('--ready_timeout_secs', type=float, default=120,
                 help='How long to wait for every task to serve its port.')
  p.add_argument('--max_restarts', type=int, default=3,
                 help='Restarts of dead tasks allowed in all.')
  return p


def _FlagValue(flags, name, default=None):
  value = default
  for f in flags:
    if f.startswith(f'--{name}='):
      value = f.split('=', 1)[1]
  return value


def Main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args, trainer_flags = _Parser().parse_known_args(argv)
  for f in trainer_flags:
    if not f.startswith('--') or '=' not in f:
      print(f'error: write trainer flags as --name=value; got {f!r}.',
            file=sys.stderr)
      return 2
    name = f[2:].split('=', 1)[0]
    if name in ('cluster_spec', 'job', 'task', 'mode', 'run_locally'):
      print(f'error: --{name} is set by lingvo_ext.launch for each process; '
            'drop it (to run tasks by hand, see README "Running on several '
            'machines").', file=sys.stderr)
      return 2
  logdir = _FlagValue(trainer_flags, 'logdir')
  if not logdir or not _FlagValue(trainer_flags, 'model'):
    print('error: --model and --logdir are required, e.g. '
          'python -m lingvo_ext.launch --model=lm.TransformerLmTinyGPipe '
          '--logdir=/tmp/lm_cluster --workers=2 --worker_split_size=2',
          file=sys.stderr)
    return 2
  if args.workers < 1:
    print(f'error: --workers={args.workers} must be >= 1.', file=sys.stderr)
    return 2
  try:
    cluster.MakeWorkerLayout(
        args.workers, int(_FlagValue(trainer_flags, 'num_cpu_devices', '1')),
        int(_FlagValue(trainer_flags, 'worker_split_size', '1')))
  except ValueError as e:
    print(f'error: {e}'.replace('--cluster_spec', '--workers'),
          file=sys.stderr)
    return 2
  return launch_lib.Launch(args.workers, trainer_flags, logdir, args.network,
                           args.ready_timeout_secs, args.max_restarts)


if __name__ == '__main__':
  sys.exit(Main())
