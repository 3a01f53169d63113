r"""Re-plans an experiment's pipeline onto the devices a cluster has left.

  .venv/bin/python -m lingvo_ext.tools.replan --model=lm.TransformerLmTinyGPipe \
      --devices=1 --replicas=1 --json

The launcher runs it in a process of its own when a worker is lost for good
(distributed/elastic.py, docs/faults.md): the planner ranks the plans for
--devices devices (the machine probed; --calibrate also times the model's
reference plans), keeps the experiment's global batch (its per-replica
input.batch_size times --replicas, the replicas before the loss), drops the
plans whose devices do not make whole workers of --devices_per_worker
devices (or whole --nodes), and takes the best whose predicted peak RSS fits
this machine's memory (planner/memory_model.py, as --plan=auto). It prints
the plan's --model_params_override (the user's, then the plan's) and trainer
flags, or with --json one object; where no plan fits, one `error:` line,
exit 1. --logdir also names the newest checkpoint of LOGDIR/train that the
new cluster resumes from.
"""

import argparse
import json
import os
import sys
from typing import Dict
from typing import Optional

from lingvo_ext import entry_point  # pylint: disable=g-bad-import-order

# isort: split
from lingvo_ext import _startup

EXIT_NO_PLAN = 1


def _Parser():
  p = argparse.ArgumentParser(
      prog='.venv/bin/python -m lingvo_ext.tools.replan',
      description=__doc__.splitlines()[0])
  p.add_argument('--model', required=True,
                 help='The registered experiment, e.g. lm.TransformerLmTiny.')
  p.add_argument('--devices', type=int, required=True,
                 help='Devices left to plan onto.')
  p.add_argument('--replicas', type=int, default=1,
                 help='Data-parallel replicas before the loss (the global '
                 'batch is input.batch_size times this).')
  p.add_argument('--model_params_override', default='',
                 help="The run's --model_params_override.")
  p.add_argument('--devices_per_worker', type=int, default=1,
                 help="Devices of each worker task (its --num_cpu_devices).")
  p.add_argument('--nodes', type=int, default=1,
                 help='The new worker count must be a multiple of it.')
  p.add_argument('--calibrate', action='store_true',
                 help="Also time the model's reference plans (cached).")
  p.add_argument('--logdir', default='',
                 help='Name the newest checkpoint of LOGDIR/train.')
  p.add_argument('--json', action='store_true', help='Print one JSON object.')
  p.add_argument('--nice', action='store_true',
                 help='Run at a lower CPU priority (the launcher plans ahead '
                 'while its cluster trains).')
  return p


def _Check(args) -> Optional[str]:
  for name in ('devices', 'replicas', 'devices_per_worker', 'nodes'):
    if getattr(args, name) < 1:
      return (f'--{name}={getattr(args, name)} must be >= 1, e.g. '
              f'--{name}=1.')
  return None


def _PipelinedPlan(cfg, args, global_batch, available, source) -> Dict:
  """The best fitting plan of a PipelinedTask as the result's fields."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  ranked = auto.ChooseForExperiment(
      cfg, args.model, args.devices, global_batch=global_batch,
      calibrate=args.calibrate, overrides=args.model_params_override)
  whole = [c for c in ranked if c.devices % args.devices_per_worker == 0 and
           (c.devices // args.devices_per_worker) % args.nodes == 0]
  if not whole:
    raise ValueError(
        f'no plan of --model={args.model} on {args.devices} device(s) makes '
        f'whole workers of {args.devices_per_worker} device(s) on '
        f'{args.nodes} node(s)')
  if available is not None:
    whole = auto.Fitting(planner.ProfileExperiment(cfg, args.model), whole,
                         memory_probe.Get(args.devices), available, source)
  best = whole[0]
  return dict(key=best.Key(), cells=best.num_cells,
              devices=best.devices,
              devices_per_replica=best.devices_per_replica,
              micro_batches=best.num_micro_batches,
              replicas=best.replicas, global_batch=best.global_batch,
              plan_override=planner.OverrideString(best),
              described=planner.Describe(best))


def _TreePlan(cfg, args, available) -> Dict:
  """The pipelines' fitting plans of an experiment that comes cut (one
  replica, its input's batch) as the result's fields."""
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  chosen = auto.PlanParams(cfg, args.model, args.devices,
                           overrides='', available=available)
  plans = [plan for _, plan in chosen.plan]
  first = plans[0]
  return dict(key='; '.join(p.Key() for p in plans),
              cells=sum(p.num_cells for p in plans),
              devices=first.devices, devices_per_replica=first.devices,
              micro_batches=first.num_micro_batches, replicas=1,
              global_batch=None, plan_override=chosen.override,
              described=chosen.line)


def Replan(args, available=None, source: str = '') -> Dict:
  """The new plan for `args` (the parsed flags) as a dict (see --json).

  Args:
    args: The parsed flags.
    available: Bytes each process may use (default: this machine's,
      task_health.AvailableBytes).
    source: What `available` is, for the message when nothing fits.

  Raises:
    ValueError: one line: no plan fits, or a bad flag or param.
  """
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.distributed import elastic  # pylint: disable=g-import-not-at-top
  from lingvo_ext.distributed import task_health  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams(args.model,
                                 overrides=args.model_params_override)
  refusal = pipeline_tree.PlannerRefusal(cfg, args.model)
  if refusal:
    raise ValueError(refusal)
  if available is None:
    available, source = task_health.AvailableBytes()
  if pipeline_tree.IsCut(cfg):
    got = _TreePlan(cfg, args, available)
  else:
    got = _PipelinedPlan(cfg, args, cfg.input.batch_size * args.replicas,
                         available, source)
  layout, why = elastic.NewLayout(got['devices'], got['devices_per_replica'],
                                  args.devices_per_worker, args.nodes)
  if layout is None:
    raise ValueError(why)
  got.update(
      model=args.model, workers=layout[0], worker_split_size=layout[1],
      num_cpu_devices=args.devices_per_worker,
      model_params_override=planner.JoinOverrides(
          args.model_params_override, got.pop('plan_override')),
      checkpoint=_Newest(args.logdir))
  return got


def _Newest(logdir: str) -> Optional[str]:
  """The basename of the newest checkpoint the trainer would restore."""
  if not logdir:
    return None
  from lingvo_ext.checkpoints import files  # pylint: disable=g-import-not-at-top
  path = files.LatestCheckpoint(os.path.join(logdir, 'train'))
  return os.path.basename(path) if path else None


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    args = _Parser().parse_args(argv)
  except SystemExit as e:
    return int(e.code or 0)
  if args.nice:
    os.nice(10)
  error = _Check(args) or entry_point.ParseFlags()
  if error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  try:
    got = Replan(args)
  except ValueError as e:
    line = str(e).strip().split('\n')[0]
    print(f'error: no plan fits {args.devices} device(s): {line}',
          file=sys.stderr)
    return EXIT_NO_PLAN
  if args.json:
    print(json.dumps(got))
    return 0
  print(f'{got["key"]} on {got["workers"]} worker(s): {got["described"]}')
  print(f"  --num_cpu_devices={got['num_cpu_devices']} "
        f"--worker_split_size={got['worker_split_size']} "
        f"--model_params_override='{got['model_params_override']}'")
  return 0


if __name__ == '__main__':
  _startup.FilterHarmlessLines()
  sys.exit(main())
