r"""Trains on a local multi-process TensorFlow cluster on 127.0.0.1.

  .venv/bin/python -m lingvo_ext.launch --model=lm.TransformerLmTinyGPipe \
      --logdir=/tmp/lm_cluster --workers=2 --worker_split_size=2

starts a controller, a trainer client and --workers worker processes of
`lingvo_ext.trainer` with a matching --cluster_spec, prints their state
changes and the trainer's progress (each task's whole log goes to
LOGDIR/launch/JOB.TASK.log; --stream_logs prints it all), restarts a task
that dies (training resumes from the last checkpoint), and stops them all
when training ends, on Ctrl-C, or when the launcher itself is killed (even
with kill -9). SIGTERM or SIGHUP (a cluster stopping the job) is forwarded to
every task: the controller saves the current step within
--shutdown_grace_secs, then everything exits; the exit code says whether
that save happened (0) or not (143); see docs/preemption.md. Every flag other than the launcher's own (below) goes to
every trainer process, e.g. --max_steps=100. With one CPU device per worker
(--num_cpu_devices=1), replica r's cell i runs on worker task r*K+i
(K = --worker_split_size), so --workers=4 --worker_split_size=2 trains 2
replicas of a 2-cell pipeline.

--cluster_from=tf_config or slurm runs the same cluster the way Kubernetes
or Slurm would: each task learns its place from TF_CONFIG or SLURM_*
variables (--cluster_resolver), with one chief process running the
controller and the trainer client. See lingvo_ext/distributed/launch_lib.py
and docs/clusters.md.

A worker lost for good (it dies past --max_restarts, or is not back within
--ready_timeout_secs of its restart) is re-planned around: the pipeline on
the workers left, the global batch kept, resumed from the newest checkpoint
(--elastic=false: the cluster stops; docs/faults.md).
"""

import argparse
import os
import sys

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-bad-import-order
from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import cluster_tasks
from lingvo_ext.distributed import launching
from lingvo_ext.runtime import shutdown


def _Parser():
  p = argparse.ArgumentParser(
      prog='.venv/bin/python -m lingvo_ext.launch',
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
                 help='How long to wait for every task to serve its port, '
                 'and for a restarted task to be back (else it is lost).')
  p.add_argument('--max_restarts', type=int, default=3,
                 help='Restarts of dead tasks allowed in all (per cluster); '
                 'a worker that dies past them is lost for good.')
  p.add_argument('--elastic', default=True,
                 type=lambda v: _Bool('--elastic', v),
                 help='true: a worker lost for good is re-planned around '
                 '(the pipeline on the workers left, resumed from the last '
                 'checkpoint; docs/faults.md); false: the cluster stops.')
  p.add_argument('--stream_logs', action='store_true',
                 help='Print every line of every task\'s log, prefixed with '
                 'its name (default: state changes, the progress line and '
                 'the tasks\' own messages; the logs are in '
                 'LOGDIR/launch/JOB.TASK.log either way).')
  p.add_argument('--cluster_from', choices=cluster_tasks.CLUSTER_FROM,
                 default='flags',
                 help='How each task learns its place: flags (--cluster_spec, '
                 '--job, --task), tf_config (TF_CONFIG) or slurm (SLURM_* '
                 'for --nodes nodes). See docs/clusters.md.')
  p.add_argument('--ps', type=int, default=0,
                 help='ps tasks, which then hold the variables (flags, '
                 'tf_config).')
  p.add_argument('--fork_tasks', default=True,
                 type=lambda v: _Bool('--fork_tasks', v),
                 help='true: fork each task from one server process that has '
                 'imported TensorFlow and Lingvo (each task starts in '
                 'milliseconds instead of seconds); false: start each as a '
                 'fresh interpreter.')
  p.add_argument('--task_timeout_secs', type=float, default=60,
                 help='A task whose server does not answer for this long '
                 '(stopped, a dropped network) is killed and restarted.')
  p.add_argument('--nodes', type=int, default=1,
                 help='--cluster_from=slurm: nodes; --workers must be a '
                 'multiple of it.')
  return p


def _Bool(flag, value):
  if value.lower() in ('true', '1'):
    return True
  if value.lower() in ('false', '0'):
    return False
  raise argparse.ArgumentTypeError(f'{flag} takes true or false, not {value!r}')


def _FlagValue(flags, name, default=None):
  value = default
  for f in flags:
    if f.startswith(f'--{name}='):
      value = f.split('=', 1)[1]
  return value


def _WarnOfMemory(trainer_flags, num_workers: int) -> None:
  """The start-up memory check, per worker task, before any task starts
  (start_memory.LaunchWarnings); --plan=auto warns with its own. An
  estimate that cannot be made (a bad flag the tasks will report) prints
  nothing."""
  from lingvo_ext.preflight import start_memory  # pylint: disable=g-import-not-at-top
  if _FlagValue(trainer_flags, 'plan', ''):
    return
  try:
    lines = start_memory.LaunchWarnings(
        _FlagValue(trainer_flags, 'model'),
        _FlagValue(trainer_flags, 'model_params_override', ''), num_workers,
        int(_FlagValue(trainer_flags, 'num_cpu_devices', '1')),
        int(_FlagValue(trainer_flags, 'worker_split_size', '1')))
  except Exception:  # pylint: disable=broad-except
    return  # A warning's estimate never stops the run it warns about.
  for line in lines:
    print(line, file=sys.stderr, flush=True)


def Main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args, trainer_flags = _Parser().parse_known_args(argv)
  for f in trainer_flags:
    if not f.startswith('--') or '=' not in f:
      print(f'error: write trainer flags as --name=value; got {f!r}.',
            file=sys.stderr)
      return 2
    name = f[2:].split('=', 1)[0]
    if name in ('cluster_spec', 'job', 'task', 'mode', 'run_locally',
                'cluster_resolver', 'slurm_port_base'):
      print(f'error: --{name} is set by lingvo_ext.launch for each process; '
            'drop it (to run tasks by hand: docs/clusters.md).',
            file=sys.stderr)
      return 2
  logdir = _FlagValue(trainer_flags, 'logdir')
  if not logdir or not _FlagValue(trainer_flags, 'model'):
    print('error: --model and --logdir are required, e.g. '
          '.venv/bin/python -m lingvo_ext.launch --model=lm.TransformerLmTinyGPipe '
          '--logdir=/tmp/lm_cluster --workers=2 --worker_split_size=2',
          file=sys.stderr)
    return 2
  if args.workers < 1:
    print(f'error: --workers={args.workers} must be >= 1.', file=sys.stderr)
    return 2
  if args.ps < 0:
    print(f'error: --ps={args.ps} must be >= 0.', file=sys.stderr)
    return 2
  if args.cluster_from == 'slurm' and (
      args.ps or args.nodes < 1 or args.workers % args.nodes):
    print(f'error: --cluster_from=slurm needs --ps=0 and --workers (got '
          f'{args.workers}) a multiple of --nodes (got {args.nodes} >= 1): '
          'each node runs the same number of cells.', file=sys.stderr)
    return 2
  try:
    layout = cluster.MakeWorkerLayout(
        args.workers, int(_FlagValue(trainer_flags, 'num_cpu_devices', '1')),
        int(_FlagValue(trainer_flags, 'worker_split_size', '1')))
  except ValueError as e:
    print(f'error: {e}'.replace('--cluster_spec', '--workers'),
          file=sys.stderr)
    return 2
  try:
    grace_s = float(_FlagValue(trainer_flags, 'shutdown_grace_secs', '20'))
  except ValueError:
    grace_s = 0
  if grace_s <= 0:
    print('error: --shutdown_grace_secs must be a number of seconds > 0, '
          'e.g. 20.', file=sys.stderr)
    return 2
  raw = _FlagValue(trainer_flags, 'preempted_exit_code', '0')
  preempted = int(raw) if raw.lstrip('-').isdigit() else None
  error = (shutdown.CheckPreemptedCode(preempted) if preempted is not None
           else f'--preempted_exit_code={raw} must be a whole number, e.g. '
           '75.')
  if error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  if args.ready_timeout_secs <= 0:
    print(f'error: --ready_timeout_secs={args.ready_timeout_secs:g} must be '
          '> 0, e.g. 120.', file=sys.stderr)
    return 2
  if args.task_timeout_secs <= 0:
    print(f'error: --task_timeout_secs={args.task_timeout_secs:g} must be > '
          '0, e.g. 60.', file=sys.stderr)
    return 2
  shutdown.SetTitle(f'lingvo_ext launch {os.path.abspath(logdir)}')
  _WarnOfMemory(trainer_flags, args.workers)
  return launching.Launch(
      args.workers, trainer_flags, logdir, args.network,
      args.ready_timeout_secs, args.max_restarts,
      stream_logs=args.stream_logs, cluster_from=args.cluster_from,
      num_ps=args.ps, nodes=args.nodes, layout=layout,
      fork_tasks=args.fork_tasks,
      shutdown_grace_s=grace_s, task_timeout_s=args.task_timeout_secs,
      preempted_code=preempted, elastic_on=args.elastic)


if __name__ == '__main__':
  sys.exit(Main())
