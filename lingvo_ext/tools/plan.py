r"""Chooses how to pipeline a registered experiment on N devices.

  .venv/bin/python -m lingvo_ext.tools.plan --model=lm.TransformerLm --devices=2
  .venv/bin/python -m lingvo_ext.tools.plan --model=lm.TransformerLm --devices=4 \
      --memory_per_device=64MB --global_batch=32 --measure --json

Enumerates the plans (K cells and their exact min-max cut, M micro-batches,
schedule, recompute, R data-parallel replicas with K * R <= N, gradient_sync),
predicts each one's step time and peak memory per device
(lingvo_ext/planner/; with --xla, each with and without XLA-compiled cells),
drops those over --memory_per_device and prints them fastest first, with
the trainer command that runs the best. --measure
times the plans predicted within --measure_within of the best, at most
--measure_top of them (and the twin without recompute of each that
recomputes), round robin in this process, --measure_steps rounds (each
one's peak RSS in a fresh process), and takes the fastest by its fastest
round of those that beat the predicted best in enough of the rounds (a sign
test over the paired rounds: planner.MeasuredChoice).

Any other experiment holding pipelines (Lingvo's GPipeTransformerLm at
task.lm.stack, a Builder stack) is planned per pipeline with its cells as
the experiment cuts them (lingvo_ext/planner/tree.py;
docs/coming-from-lingvo.md); a time axis trimmed at run time is sized from a
few Train batches read now.
--model_params_override changes the params first, as in the trainer.
"""

import argparse
import difflib
import json
import sys
from typing import Dict
from typing import Optional

from lingvo_ext import entry_point  # pylint: disable=g-bad-import-order

# isort: split
from lingvo_ext import _startup
from lingvo_ext import planner
from lingvo_ext.planner import auto
from lingvo_ext.planner import measuring


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


def _LengthDict(length) -> Optional[Dict]:
  """A pipeline's SequenceLength for --json, or None (a static time axis)."""
  if length is None:
    return None
  return dict(length=length.length, read=list(length.read),
              maximum=length.maximum, given=length.given)


def _ApplyResolved(cfg, plan):
  """`plan` applied to `cfg`, then each 'auto' jit_compile set to its faster
  build (cached, else timed), as the trainer does; in this process, which
  ends after the plans are timed."""
  from lingvo_ext.runtime import jit_resolve  # pylint: disable=g-import-not-at-top
  cfg = planner.ApplyPlan(cfg, plan)
  for decision in jit_resolve.Resolve(cfg, plan.devices_per_replica,
                                      fresh_process=False):
    print('[plan] %s: %s' % (plan.Key(), decision.Line()), file=sys.stderr,
          flush=True)
  return cfg


def _MainTree(args, cfg) -> int:
  """The planner's output for an experiment whose pipelines come cut."""
  if args.measure:
    return _Fail('--measure times PipelinedTask plans; --model=%s holds its '
                 'pipelines already cut: leave --measure out.' % args.model)
  if args.xla:
    return _Fail('--xla plans PipelinedTask experiments; --model=%s holds its '
                 'pipelines already cut: leave --xla out (their jit_compile '
                 "is the trainer's --jit_compile)." % args.model)
  if args.global_batch is not None:
    return _Fail('--global_batch: --model=%s takes its batch from its input '
                 'params; leave --global_batch out.' % args.model)
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  try:
    ranked = auto.ChooseTreeForExperiment(cfg, args.model, args.devices,
                                          args.memory_bytes,
                                          calibrate=args.calibrate,
                                          recalibrate=args.recalibrate)
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
        trainer_flags=['--%s=%d' % kv
                       for kv in auto.TreeFlags(chosen).items()],
        command=auto.TreeCommand(args.model, chosen,
                            args.model_params_override))))
    return 0
  for pipe, plans in ranked:
    print('%d plans for %s (%s, its %d cells as the experiment cuts them) on '
          '%d devices%s, fastest first (predicted, %s):' % (
              len(plans), pipe.path, pipe.cls_name, len(pipe.profile.layers),
              args.devices,
              (' within %s each' % planner.FormatSize(args.memory_bytes)
               if args.memory_bytes else ''),
              'calibrated on its own cells' if args.calibrate else
              'machine probed, not calibrated'))
    if pipe.length:
      print('  sized for ' + pipe.length.Describe())
    print(planner.Table(plans, args.limit))
    print()
    print('best for %s: %s' % (pipe.path, planner.Describe(plans[0])))
    print('  ' + tree.TreeOverrideString([(pipe, plans[0])]))
    print()
  print('run it with:')
  print('  ' + auto.TreeCommand(args.model, chosen,
                                args.model_params_override))
  return 0


# --- The command line ---------------------------------------------------------


def _PeakRss(cfg, model: str, best, devices: int) -> str:
  """The best plan's predicted peak RSS line (planner/memory_model.py, this
  machine's constants: memory_probe, probed on first use)."""
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  profile = planner.ProfileExperiment(cfg, model)
  try:
    constants = memory_probe.Get(devices)
  except RuntimeError as e:  # The probe's one line says why.
    return f'its peak RSS (predicted): unknown: {e}'
  got = memory_model.Predict(profile, best.plan, constants)
  size = planner.FormatSize
  terms = ', '.join(f'{n} {size(b)}' for n, b in sorted(
      got.terms, key=lambda t: -t[1]) if b >= 2**20)
  return f'its peak RSS (predicted): {size(got.rss_bytes)} ({terms})'


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
  parser.add_argument('--measure_top', type=int,
                      default=measuring.MEASURE_TOP,
                      help='At most this many plans --measure times '
                      '(default %(default)s).')
  parser.add_argument('--measure_within', type=float,
                      default=measuring.MEASURE_WITHIN,
                      help='--measure times the plans predicted within this '
                      'fraction of the best\'s step time (default '
                      '%(default)s: 15%%).')
  parser.add_argument('--measure_steps', type=int,
                      default=measuring.MEASURE_STEPS,
                      help='Timed rounds (one step of each plan per round) '
                      '(default %(default)s).')
  parser.add_argument(
      '--calibrate', action=argparse.BooleanOptionalAction, default=True,
      help='Time the model\'s reference plans first to fit the cost model '
      '(default; cached per model and machine); --no-calibrate uses the '
      'machine probe alone.')
  parser.add_argument(
      '--recalibrate', action='store_true',
      help='Time the reference plans again even if a calibration is cached '
      '(what a plan check off by more than 25%% suggests).')
  parser.add_argument(
      '--xla', action='store_true',
      help='Plan each choice with and without XLA-compiled cells '
      '(task.jit_compile True, False), XLA timed too; else left to the '
      "trainer's timing (docs/performance.md).")
  parser.add_argument('--json', action='store_true',
                      help='Print one JSON object: the ranked plans and the '
                      'best one\'s override and flags.')
  parser.add_argument('--limit', type=int, default=15,
                      help='Rows of the table (default %(default)s).')
  return parser.parse_args(argv)


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
            (args.measure_top, measuring.MEASURE_TOP))
  error = measuring.TooFewRounds('--measure_steps', args.measure_steps,
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
  error = _CheckArgs(args) or entry_point.ParseFlags()
  if error:
    return _Fail(error)
  from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
  if registry.CheckModel(args.model):
    return _Fail(_UnknownModel(args.model))
  # Timed on the threads a trainer on --devices gets, as the plan check
  # times its calibration (runtime/plan_prediction.py).
  from lingvo_ext.runtime import plan_prediction  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import trainer_flags  # pylint: disable=g-import-not-at-top
  plan_prediction.TrainersThreadPool(trainer_flags.Options(
      model=args.model, run_locally='cpu',
      num_cpu_devices=args.devices).IntraOpThreads(), args.devices)
  try:
    cfg = planner.ExperimentParams(args.model,
                                   overrides=args.model_params_override)
    from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
    refusal = pipeline_tree.PlannerRefusal(cfg, args.model)
    if refusal:
      return _Fail(refusal)
    if pipeline_tree.IsCut(cfg):
      return _MainTree(args, cfg)
    plans = auto.ChooseForExperiment(cfg, args.model, args.devices,
                                     args.memory_bytes, args.global_batch,
                                     calibrate=args.calibrate,
                                     overrides=args.model_params_override,
                                     xla=args.xla,
                                     recalibrate=args.recalibrate)
  except ValueError as e:  # PlanError, or a bad param: one line.
    return _Fail(str(e).strip().split('\n')[0])
  noise = None
  if args.measure:
    top = measuring.MeasureCandidates(plans, args.measure_top,
                                      args.measure_within)
    top = measuring.MeasurePlans(args.model, top, steps=args.measure_steps,
                                 overrides=args.model_params_override,
                                 apply=_ApplyResolved)
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
  print(_PeakRss(cfg, args.model, best, args.devices))
  print('run it with:')
  print('  ' + planner.Command(args.model, best,
                               args.model_params_override))
  return 0


if __name__ == '__main__':
  _startup.FilterHarmlessLines()  # The program's console, not a caller's.
  sys.exit(main())
