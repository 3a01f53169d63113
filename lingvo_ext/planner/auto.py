r"""Chooses how to pipeline a registered experiment on N devices.

  .venv/bin/python -m lingvo_ext.tools.plan --model=lm.TransformerLm --devices=2
  .venv/bin/python -m lingvo_ext.tools.plan --model=lm.TransformerLm --devices=4 \
      --memory_per_device=64MB --global_batch=32 --measure --json

Enumerates the plans (K cells and their exact min-max cut, M micro-batches,
schedule, recompute, R data-parallel replicas with K * R <= N, gradient_sync),
predicts each one's step time and peak memory per device
(lingvo_ext/core/planner/), drops those over --memory_per_device and prints
them fastest first, with the trainer command that runs the best. --measure
times the plans predicted within --measure_within of the best, at most
--measure_top of them (and the twin without recompute of each that
recomputes), round robin in this process, --measure_steps rounds (each
one's peak RSS in a fresh process), and takes the fastest by its fastest
round of those that beat the predicted best in enough of the rounds (a sign
test over the paired rounds: planner.MeasuredChoice).

Any other experiment holding pipelines (Lingvo's GPipeTransformerLm at
task.lm.stack, a Builder stack) is planned per pipeline with its cells as
the experiment cuts them (planner/tree.py; docs/coming-from-lingvo.md); a
time axis trimmed at run time is sized from a few Train batches read now.
--model_params_override changes the params first, as in the trainer.
"""

import argparse
import difflib
import json
import multiprocessing
import os
import sys
import time
from typing import Dict, List, Optional

from lingvo_ext.core import planner

# Process memory besides the model, only for the process totals printed
# (the budget is per device, without it): what bench/plan.py's calibration
# found for lm.TransformerLmTiny on the development machine (its M=1
# reference's peak RSS less the predicted model and graph bytes; see
# docs/benchmarks.md, "Planner").
PROCESS_OVERHEAD_BYTES = 730 * 2**20
# Timed rounds of --measure and of the calibration's reference plans: a
# round is one step of each plan, milliseconds on small models, so rounds are
# cheap beside building the plans, and a candidate needs several
# (planner.MinRounds) to show that it beats the predicted best.
MEASURE_STEPS = 20
# --measure's defaults: it times the plans predicted within MEASURE_WITHIN of
# the predicted best, at most MEASURE_TOP of them: on tiny models the
# predictions do not tell plans this close apart (docs/benchmarks.md,
# "Planner").
MEASURE_WITHIN = 0.15
MEASURE_TOP = 8
MEASURE_WARMUP = 2


def _Fail(message: str) -> int:
  print('error: ' + message.replace('\n', ' '), file=sys.stderr)
  return 2


def _UnknownModel(model: str) -> str:
  from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
  names = registry.RegisteredModels(model)
  close = difflib.get_close_matches(model, names, n=3, cutoff=0.5)
  hint = ('did you mean %s? ' % ', '.join(close)) if close else ''
  return ('--model=%s is not a registered experiment; %spass one of '
          '`.venv/bin/python -m lingvo_ext.tools.list_models`.' % (model, hint))


# --- Measuring plans in child processes -------------------------------------


def RoundRobin(runs, rounds: int, warmup: int) -> List[List[float]]:
  """Seconds of each run() over `rounds` rounds, taken in turn (the order
  rotating each round), so that load that comes and goes hits all alike."""
  for run in runs:
    for _ in range(warmup):
      run()
  times = [[] for _ in runs]
  order = list(range(len(runs)))
  for r in range(rounds):
    k = r % len(order)
    for i in order[k:] + order[:k]:
      t = time.perf_counter()
      runs[i]()
      times[i].append(time.perf_counter() - t)
  return times


class Measurer:
  """Runs jobs in fresh processes forked from a server that has imported TF.

  Each job gets its own process, so its peak RSS is its own; the fork server
  (multiprocessing's forkserver, with `preload` imported once) saves the
  import of TensorFlow per job.
  """

  def __init__(self, fn, preload: List[str], timeout_s: float = 300):
    self._ctx = multiprocessing.get_context('forkserver')
    self._ctx.set_forkserver_preload(preload)
    self._fn = fn
    self.timeout_s = timeout_s

  def Measure(self, job: Dict) -> Dict:
    try:
      with self._ctx.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply_async(self._fn, (job,)).get(self.timeout_s)
    except Exception as e:  # pylint: disable=broad-except
      print('[plan] measuring %s failed: %r' % (job.get('plan', {}).get(
          'key', job), e), file=sys.stderr, flush=True)
      return dict(step_s=None, rss_bytes=None, error=repr(e))


def MeasurePlans(model: str, plans: List[planner.Candidate],
                 steps: int = MEASURE_STEPS,
                 warmup: int = MEASURE_WARMUP,
                 overrides: str = '') -> List[planner.Candidate]:
  """The candidates with their Measurement: step times and peak RSS.

  Step times: all plans built in this process and timed in turn, `steps`
  rounds (RoundRobin), the fastest round (the least disturbed by other
  processes); peak RSS: each plan in a fresh process. `overrides`: the
  user's --model_params_override, applied before each plan's.
  """
  built = [planner.BuildExperimentStep(model, p, overrides) for p in plans]
  times = RoundRobin([lambda s=s: s[0].run(s[1]) for s in built], steps,
                     warmup)
  for sess, _ in built:
    sess.close()
  measurer = Measurer(planner.MeasureJob, ['lingvo_ext.core.planner'])
  out = []
  for p, t in zip(plans, times):
    rss = measurer.Measure(dict(model=model, plan=p.plan.ToDict(), steps=2,
                                warmup=0, overrides=overrides)
                          ).get('rss_bytes')
    out.append(p.Measured(step_s=min(t), times=t, rss_bytes=rss))
  return out


# --- Choosing -----------------------------------------------------------------


def MeasureCandidates(ranked: List[planner.Candidate], top: int,
                      within: float = MEASURE_WITHIN
                     ) -> List[planner.Candidate]:
  """The plans --measure times, the predicted best first.

  The predicted best and every plan predicted within `within` of its step
  time (the predictions' own error: one of them may well be the fastest),
  at most `top` in predicted order; and for each that recomputes, its twin
  without recompute if it fits (planner.MeasuredChoice prefers it within
  noise).
  """
  bound = ranked[0].step_s * (1. + within) if ranked else 0.
  out = [p for p in ranked[:top] if p is ranked[0] or p.step_s <= bound]
  for p in list(out):
    twin = planner.Twin(p, ranked)
    if twin is not None and twin not in out:
      out.append(twin)
  return out


def Machine(num_devices: int, model: Optional[str] = None,
            profile: Optional[planner.ModelProfile] = None,
            overhead_bytes: float = PROCESS_OVERHEAD_BYTES,
            overrides: str = ''):
  """This host's Machine, probed under the trainer's session config.

  With `model` and `profile`, calibrated (planner.Calibrate) on the model's
  reference plans (after `overrides`, a --model_params_override text),
  timed in turn in this process.
  """
  machine = planner.ProbeMachine(planner.SessionConfig(num_devices),
                                 overhead_bytes=overhead_bytes)
  if model and profile:
    refs = planner.ReferencePlans(profile, devices=num_devices)
    steps = [planner.BuildExperimentStep(model, ref, overrides)
             for ref in refs]
    times = RoundRobin([lambda s=s: s[0].run(s[1]) for s in steps],
                       MEASURE_STEPS, 1)
    for sess, _ in steps:
      sess.close()
    machine = planner.Calibrate(profile, machine, [min(t) for t in times])
  return machine


def ChooseForExperiment(model_params, name: str, devices: int,
                        memory_per_device: Optional[float] = None,
                        global_batch: Optional[int] = None,
                        machine: Optional[planner.Machine] = None,
                        calibrate: bool = True,
                        overrides: str = '') -> List[planner.Candidate]:
  """Ranked predicted plans of an experiment's params (PlanError if none).

  Without `machine`, this host's, probed, and with `calibrate` calibrated on
  the experiment `name`'s reference plans (see Machine), `overrides` (the
  --model_params_override that made `model_params`) applied to them.
  """
  profile = planner.ProfileExperiment(model_params, name)
  machine = machine or Machine(devices, name if calibrate else None, profile,
                               overrides=overrides)
  return planner.Choose(profile, devices, memory_per_device, global_batch,
                        machine)


def ChooseAndApply(model_params, name: str, devices: int,
                   memory_per_device: Optional[float] = None,
                   global_batch: Optional[int] = None,
                   machine: Optional[planner.Machine] = None,
                   overrides: str = ''):
  """Picks the best predicted plan and sets it on `model_params`.

  Returns:
    (the plan, the trainer flags it needs: --num_cpu_devices and
    --worker_split_size as a dict).
  """
  plan = ChooseForExperiment(model_params, name, devices, memory_per_device,
                             global_batch, machine, overrides=overrides)[0]
  planner.ApplyPlan(model_params, plan)
  return plan, dict(num_cpu_devices=plan.devices,
                    worker_split_size=plan.devices_per_replica)


def ChooseTreeForExperiment(model_params, name: str, devices: int,
                            memory_per_device: Optional[float] = None,
                            machine: Optional[planner.Machine] = None):
  """Each pipeline of a non-PipelinedTask experiment with its ranked plans.

  Its cells as cut, one replica (planner.tree); the machine probed, not
  calibrated (the reference plans cut a LayerStack).
  """
  from lingvo_ext.core.planner import tree  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  # A time-major Lingvo LM feeding a batch-major pipeline: its one line, not
  # the shape error profiling would meet.
  pipeline_tree._CheckTimeMajorLm(model_params.task)  # pylint: disable=protected-access
  pipes = tree.ProfileTree(model_params, name)
  machine = machine or planner.ProbeMachine(
      planner.SessionConfig(devices), overhead_bytes=PROCESS_OVERHEAD_BYTES)
  return tree.ChooseTree(pipes, devices, memory_per_device, machine)


def TreeFlags(chosen) -> Dict[str, int]:
  """The trainer flags the pipelines' chosen plans need (one replica)."""
  devices = chosen[0][1].devices_per_replica
  return dict(num_cpu_devices=devices, worker_split_size=devices)


def TreeCommand(model: str, chosen, overrides: str = '') -> str:
  """The trainer command line that runs the pipelines' chosen plans (after
  `overrides`, the user's --model_params_override)."""
  from lingvo_ext.core.planner import tree  # pylint: disable=g-import-not-at-top
  flags = ' '.join('--%s=%d' % kv for kv in TreeFlags(chosen).items())
  return (".venv/bin/python -m lingvo_ext.trainer --model=%s %s "
          "--model_params_override='%s' --logdir=LOGDIR" %
          (model, flags, planner.JoinOverrides(
              overrides, tree.TreeOverrideString(chosen))))


def TrainerAutoPlan(model: str, devices: int,
                    memory_per_device: Optional[str] = None,
                    overrides: str = '', gpipe_engine: str = 'lingvo_ext'):
  """The trainer's --plan=auto: the best plan for `model` on `devices`.

  Args:
    model: The registered experiment (--model).
    devices: --devices.
    memory_per_device: --memory_per_device text, or None.
    overrides: The user's --model_params_override, applied first.
    gpipe_engine: --gpipe_engine; the planner plans lingvo_ext's.

  Returns:
    (the plan (for an experiment other than a PipelinedTask: [(pipeline,
    plan)]), its --model_params_override text, the trainer flags it needs as
    a dict, one line to log).

  Raises:
    ValueError: a one-line message naming the flag (a bad size, or no plan
      fits the budget).
  """
  if devices < 1:
    raise ValueError('--devices=%d must be >= 1; pass the number of devices '
                     'to plan for, e.g. --devices=2.' % devices)
  budget = None
  if memory_per_device:
    try:
      budget = planner.ParseSize(memory_per_device)
    except ValueError as e:
      raise ValueError('--memory_per_device=%s: %s' %
                       (memory_per_device, e)) from None
  if gpipe_engine != 'lingvo_ext':
    raise ValueError(f'--plan=auto plans lingvo_ext\'s engine, not '
                     f'--gpipe_engine={gpipe_engine}; pass '
                     '--gpipe_engine=lingvo_ext or leave --plan out.')
  cfg = planner.ExperimentParams(model, overrides=overrides)
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  refusal = pipeline_tree.PlannerRefusal(cfg, model)
  if refusal:
    raise ValueError('--plan=auto: ' + refusal)
  if pipeline_tree.IsCut(cfg):
    from lingvo_ext.core.planner import tree  # pylint: disable=g-import-not-at-top
    ranked = ChooseTreeForExperiment(cfg, model, devices, budget)
    chosen = [(pipe, plans[0]) for pipe, plans in ranked]
    text = tree.TreeOverrideString(chosen)
    flags = TreeFlags(chosen)
    described = '; '.join(
        '%s %s%s' % (pipe.path, planner.Describe(plan),
                     ' (sized for %s)' % pipe.length.Describe()
                     if pipe.length else '')
        for pipe, plan in chosen)
    flag_text = ' '.join('--%s=%d' % kv for kv in flags.items())
    plan = chosen
  else:
    plan, flags = ChooseAndApply(cfg, model, devices, budget,
                                 overrides=overrides)
    text = planner.OverrideString(plan)
    described = planner.Describe(plan)
    flag_text = ' '.join(planner.TrainerFlags(plan))
  text = planner.JoinOverrides(overrides, text)
  line = ('--plan=auto chose %s; running it with %s '
          "--model_params_override='%s'" % (described, flag_text, text))
  return plan, text, flags, line


def _LengthDict(length) -> Optional[Dict]:
  """A pipeline's SequenceLength for --json, or None (a static time axis)."""
  if length is None:
    return None
  return dict(length=length.length, read=list(length.read),
              maximum=length.maximum, given=length.given)


def _MainTree(args, cfg) -> int:
  """The planner's output for an experiment whose pipelines come cut."""
  if args.measure:
    return _Fail('--measure times PipelinedTask plans; --model=%s holds its '
                 'pipelines already cut: leave --measure out.' % args.model)
  if args.global_batch is not None:
    return _Fail('--global_batch: --model=%s takes its batch from its input '
                 'params; leave --global_batch out.' % args.model)
  from lingvo_ext.core.planner import tree  # pylint: disable=g-import-not-at-top
  try:
    ranked = ChooseTreeForExperiment(cfg, args.model, args.devices,
                                     args.memory_bytes)
  except ValueError as e:  # PlanError, or a bad param: one line.
    return _Fail(str(e).strip().split('\n')[0])
  chosen = [(pipe, plans[0]) for pipe, plans in ranked]
  if args.json:
    print(json.dumps(dict(
        model=args.model, devices=args.devices,
        memory_per_device=args.memory_bytes,
        pipelines=[dict(path=pipe.path, cls=pipe.cls_name,
                        cells=len(pipe.profile.layers),
                        sequence_length=_LengthDict(pipe.length),
                        plans=[p.ToDict() for p in plans],
                        best=plans[0].ToDict(),
                        overrides=tree.TreeOverrides(pipe, plans[0]))
                   for pipe, plans in ranked],
        model_params_override=planner.JoinOverrides(
            args.model_params_override, tree.TreeOverrideString(chosen)),
        trainer_flags=['--%s=%d' % kv for kv in TreeFlags(chosen).items()],
        command=TreeCommand(args.model, chosen,
                            args.model_params_override))))
    return 0
  for pipe, plans in ranked:
    print('%d plans for %s (%s, its %d cells as the experiment cuts them) on '
          '%d devices%s, fastest first (predicted, machine probed, not '
          'calibrated):' % (
              len(plans), pipe.path, pipe.cls_name, len(pipe.profile.layers),
              args.devices,
              (' within %s each' % planner.FormatSize(args.memory_bytes)
               if args.memory_bytes else '')))
    if pipe.length:
      print('  sized for ' + pipe.length.Describe())
    print(planner.Table(plans, args.limit))
    print()
    print('best for %s: %s' % (pipe.path, planner.Describe(plans[0])))
    print('  ' + tree.TreeOverrideString([(pipe, plans[0])]))
    print()
  print('run it with:')
  print('  ' + TreeCommand(args.model, chosen, args.model_params_override))
  return 0


# --- The command line ---------------------------------------------------------


def _ParseArgs(argv):
  parser = argparse.ArgumentParser(
      prog=".venv/bin/python -m lingvo_ext.tools.plan",
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='\n'.join(__doc__.splitlines()[1:]))
  parser.add_argument('--model', required=True,
                      help='A registered experiment, e.g. lm.TransformerLm.')
  parser.add_argument('--devices', type=int, required=True,
                      help='Devices available, N.')
  parser.add_argument('--model_params_override', default='',
                      help="Params to change before planning, as the "
                      "trainer's flag, e.g. 'task.lm.stack.splits:4'.")
  parser.add_argument('--memory_per_device', default=None,
                      help='Memory budget of each device, e.g. 512MB or 2GB.')
  parser.add_argument('--global_batch', type=int, default=None,
                      help="Examples per step over all replicas (default: "
                      "the experiment's input batch_size).")
  parser.add_argument('--measure', action='store_true',
                      help='Time the best predicted plans and take the '
                      'fastest measured (docs/performance.md).')
  parser.add_argument('--measure_top', type=int, default=MEASURE_TOP,
                      help='At most this many plans --measure times '
                      '(default %(default)s).')
  parser.add_argument('--measure_within', type=float, default=MEASURE_WITHIN,
                      help='--measure times the plans predicted within this '
                      'fraction of the best\'s step time (default '
                      '%(default)s: 15%%).')
  parser.add_argument('--measure_steps', type=int, default=MEASURE_STEPS,
                      help='Timed rounds (one step of each plan per round) '
                      '(default %(default)s).')
  parser.add_argument(
      '--calibrate', action=argparse.BooleanOptionalAction, default=True,
      help='Time the model\'s reference plans first to fit the cost model '
      '(default); --no-calibrate uses the machine probe alone.')
  parser.add_argument('--json', action='store_true',
                      help='Print one JSON object: the ranked plans and the '
                      'best one\'s override and flags.')
  parser.add_argument('--limit', type=int, default=15,
                      help='Rows of the table (default %(default)s).')
  return parser.parse_args(argv)


def TooFewRounds(flag: str, rounds: int, measure_top: int) -> Optional[str]:
  """A one-line message if `rounds` timed rounds (flag `flag`) are too few
  for the --measure choice among measure_top candidates, else None."""
  # Each candidate may bring its twin without recompute.
  least = planner.MinRounds(2 * measure_top)
  if rounds >= least:
    return None
  return ('%s=%d: with --measure_top=%d a candidate needs at least %d rounds '
          'to beat the predicted best; pass %s=%d or more (default %d).' % (
              flag, rounds, measure_top, least, flag, least, MEASURE_STEPS))


def _CheckArgs(args) -> Optional[str]:
  """One-line message for a bad flag, or None."""
  if args.devices < 1:
    return ('--devices=%d must be >= 1; pass the number of devices to plan '
            'for, e.g. --devices=2.' % args.devices)
  if args.global_batch is not None and args.global_batch < 1:
    return ('--global_batch=%d must be >= 1; pass examples per step, e.g. '
            '--global_batch=32, or leave it out.' % args.global_batch)
  if args.memory_per_device is not None:
    try:
      args.memory_bytes = planner.ParseSize(args.memory_per_device)
    except ValueError as e:
      return '--memory_per_device=%s: %s' % (args.memory_per_device, e)
  else:
    args.memory_bytes = None
  if args.measure_top < 1:
    return ('--measure_top=%d must be >= 1, e.g. --measure_top=%d.' %
            (args.measure_top, MEASURE_TOP))
  error = TooFewRounds('--measure_steps', args.measure_steps,
                       args.measure_top)
  if error:
    return error
  if not args.measure_within >= 0:
    return ('--measure_within=%s must be >= 0 (a fraction of the predicted '
            'best\'s step time), e.g. --measure_within=0.15.' %
            args.measure_within)
  return None


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    args = _ParseArgs(argv)
  except SystemExit as e:
    return int(e.code or 0)
  error = _CheckArgs(args)
  if error:
    return _Fail(error)
  from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
  if registry.CheckModel(args.model):
    return _Fail(_UnknownModel(args.model))
  try:
    cfg = planner.ExperimentParams(args.model,
                                   overrides=args.model_params_override)
    from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
    refusal = pipeline_tree.PlannerRefusal(cfg, args.model)
    if refusal:
      return _Fail(refusal)
    if pipeline_tree.IsCut(cfg):
      return _MainTree(args, cfg)
    plans = ChooseForExperiment(cfg, args.model, args.devices,
                                args.memory_bytes, args.global_batch,
                                calibrate=args.calibrate,
                                overrides=args.model_params_override)
  except ValueError as e:  # PlanError, or a bad param: one line.
    return _Fail(str(e).strip().split('\n')[0])
  noise = None
  if args.measure:
    top = MeasureCandidates(plans, args.measure_top, args.measure_within)
    top = MeasurePlans(args.model, top, steps=args.measure_steps,
                       overrides=args.model_params_override)
    measured = {p.Key(): p for p in top}
    plans = [measured.get(p.Key(), p) for p in plans]
    chosen, noise = planner.MeasuredChoice(top)
    plans = planner.Rank(plans, args.memory_bytes, measured=True)
    plans.remove(chosen)
    plans.insert(0, chosen)
  best = plans[0]
  if args.json:
    print(json.dumps(dict(
        model=args.model, devices=args.devices,
        memory_per_device=args.memory_bytes,
        plans=[p.ToDict() for p in plans],
        best=best.ToDict(),
        measure_noise=noise,
        model_params_override=planner.JoinOverrides(
            args.model_params_override, planner.OverrideString(best)),
        trainer_flags=planner.TrainerFlags(best),
        command=planner.Command(args.model, best,
                                args.model_params_override))))
    return 0
  print('%d plans for %s on %d devices%s, fastest first (predicted%s):' % (
      len(plans), args.model, args.devices,
      (' within %s each' % planner.FormatSize(args.memory_bytes)
       if args.memory_bytes else ''),
      '; %d measured over %d rounds (spread %.0f%%), the first chosen '
      'where it beat the predicted best round after round' % (
          len(top), args.measure_steps, 100 * noise)
      if args.measure else ''))
  print(planner.Table(plans, args.limit))
  print()
  print('best: ' + planner.Describe(best))
  print('run it with:')
  print('  ' + planner.Command(args.model, best,
                               args.model_params_override))
  return 0


if __name__ == '__main__':
  sys.exit(main())
