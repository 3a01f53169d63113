"""The planner's predictions against measurements, over every plan of a sweep.

For shipped experiments (lingvo_ext/tools/plan.py's models) and the FC
benchmark of bench/pipeline.py (8 FC layers, a per-example loss in the last
cell: a loss linear in the pipeline's outputs, so every schedule applies),
enumerates every plan the planner offers on --devices CPU devices
(lingvo_ext/planner/; the FC benchmark runs one replica), or those
with M in --micro_batches, predicts each, then times them all in turn in
one process (round robin, the median of --rounds) and reads each one's peak
RSS in a fresh process (forked from a server that has imported TensorFlow).
Per model it reports:

- Spearman's rank correlation of predicted and measured step times;
- step time: the relative error |predicted - measured| / measured per plan
  (mean and worst);
- peak memory: the predicted peak RSS (planner/memory_model.py, the
  start-up check's and the plan check's model) against the measured peak
  RSS, likewise; and again with the model's runtime term (a trainer's) in
  place of the sweep's own process's (BaselineRss);
- chosen vs best: the measured step time of the plan the planner ranks first
  without measuring, over the best measured step time in the sweep, and of
  the plan `--measure` picks after timing its candidates again, round robin
  (measuring.MeasureCandidates: those predicted within --measure_within of
  the best, at most --measure_top, and their twins without recompute;
  planner.MeasuredChoice: the fastest of those that beat the predicted best
  in enough of the paired rounds, a sign test);
- the same two ratios side by side: the sweep's CONFIRM_FASTEST fastest
  plans, its fastest of one cell and of more, and the two choices timed
  again in one round robin (the sweep's fastest is partly the luck of its
  least disturbed rounds); and that fastest of more cells over that of one.

Calibration (once per model, not counted in the comparison): the machine
probe (FLOP rate, per-op time, devices at once, hand-off, gate, add rate),
then the reference plans of planner.ReferencePlans, timed beside the
sweep in their own sessions, and the peak RSS of two of them
(planner.Calibrate).

  .venv/bin/python bench/plan.py                    # JSON lines, default sweep
  .venv/bin/python bench/plan.py --markdown         # tables for docs
  .venv/bin/python bench/plan.py --models fc --devices 2 --markdown
  .venv/bin/python bench/plan.py --micro_batches 1 4   # a shorter sweep
  .venv/bin/python bench/plan.py --xla --markdown      # XLA's effect
  .venv/bin/python bench/plan.py --models pipelined --markdown  # FC 256-1024,
      # a Lingvo task LM and an encoder-decoder (bench/plan_models.py)
"""

import atexit
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from lingvo_ext import entry_point  # pylint: disable=g-import-not-at-top,g-bad-import-order

# isort: split
from bench import harness  # pylint: disable=g-import-not-at-top,g-bad-import-order
from bench import plan_models  # pylint: disable=g-import-not-at-top,g-bad-import-order
from bench import plan_report  # pylint: disable=g-import-not-at-top,g-bad-import-order
from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
from lingvo_ext.planner import measuring  # pylint: disable=g-import-not-at-top

# Kept where callers found it.
Spearman = plan_report.Spearman

FC = 'fc'
DEFAULT_MODELS = ('lm.TransformerLmTiny', 'image.ConvClassifierTiny', FC)
# Where pipelining matters (2 cells can beat 1), a Lingvo task model and an
# encoder-decoder (bench/plan_models.py): --models pipelined.
PIPELINED_MODELS = ('fc256', 'fc512', 'fc1024', plan_models.LINGVO_LM,
                    plan_models.LINGVO_MT)


def _Log(msg: str) -> None:
  print('[bench/plan] ' + msg, file=sys.stderr, flush=True)


def BuildStep(model: str, plan: planner.Plan):
  if plan_models.FcWidth(model):
    return plan_models.BuildFcStep(plan, plan_models.FcWidth(model))
  if plan_models.IsTree(model):
    return plan_models.TreeStep(model, plan)
  return planner.BuildExperimentStep(model, plan)


def MeasureJob(job: Dict) -> Dict:
  """Runs in a child: one plan's step times and peak RSS."""
  # The fork server's children start with absl's flags unparsed, and
  # Lingvo's layers read them as they build (the encoder-decoder's causal
  # self-attention).
  error = entry_point.ParseFlags()
  if error:
    raise ValueError(error)
  # Each child writes a tree model's data again (plan_models.Tree): removed
  # when it is done, as the fork server's children skip atexit.
  try:
    if job.get('baseline'):
      return dict(rss_bytes=BaselineRss(job['model'], job['devices']))
    plan = planner.PlanFromDict(job['plan'])
    sess, train = BuildStep(job['model'], plan)
    times = planner.TimeSteps(lambda: sess.run(train), job['steps'],
                              job['warmup'])
    sess.close()
  finally:
    plan_models.Cleanup()
  return dict(step_s=statistics.median(times), times=times,
              rss_bytes=planner.RssBytes('VmHWM'))


def BaselineRss(model: str, devices: int) -> float:
  """The peak RSS of this process once a session on the model's devices has
  run a step of nothing: the runtime's own, in the process the sweep
  measures (a fork server's child), where the memory model's runtime term is
  a trainer's (memory_probe). A tree model's child first writes, registers
  and profiles the model (plan_models.Tree), as MeasureJob's does before
  it builds the plan's step: that is counted here too."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  if plan_models.IsTree(model):
    plan_models.Tree(model)
  config = (plan_models.FcSessionConfig(devices) if plan_models.FcWidth(model)
            else planner.SessionConfig(devices))
  graph = tf.Graph()
  with graph.as_default():
    one = tf.constant(1.) + 1.
  with tf.Session(graph=graph, config=config) as sess:
    sess.run(one)
  return planner.RssBytes('VmHWM')


# --- The sweep ----------------------------------------------------------------


def Profile(model: str) -> planner.ModelProfile:
  if plan_models.FcWidth(model):
    return plan_models.FcProfile(model)
  if plan_models.IsTree(model):
    return plan_models.Tree(model)[2][0].profile
  return planner.ProfileExperiment(planner.ExperimentParams(model), model)


def ReferencePlans(model: str, profile: planner.ModelProfile,
                   devices: int) -> List[planner.Plan]:
  """The plans the model's calibration times."""
  if plan_models.IsTree(model):
    from lingvo_ext.planner import tree_calibration  # pylint: disable=g-import-not-at-top
    return tree_calibration.ReferencePlans(plan_models.Tree(model)[2][0])
  # The FC benchmark runs one replica: no 'all_reduce' reference.
  return planner.ReferencePlans(
      profile, devices=1 if plan_models.FcWidth(model) else devices)


def SweepPlans(model: str, profile: planner.ModelProfile, devices: int,
               micro_batches=None) -> List[planner.Plan]:
  """Every plan planner.Enumerate offers on `devices` (the FC benchmark: one
  replica), or only those with M in `micro_batches` if given."""
  if plan_models.IsTree(model):
    # A pipeline whose input has a dimension known only at run time (a
    # sequence length read from its data) offers no 'recurrent' plan, as
    # tools.plan's (tree._Ranked).
    pipe = plan_models.Tree(model)[2][0]
    return plan_models.TreeSweep(profile, devices,
                                 static_shapes=pipe.length is None,
                                 micro_batches=micro_batches)
  plans = planner.Enumerate(profile, devices, micro_batches=micro_batches)
  if plan_models.FcWidth(model):
    plans = [p for p in plans if p.replicas == 1]
  return plans


def TimePlans(model: str, plans: Sequence[planner.Plan], rounds: int,
              warmup: int, every_round: bool = False,
              built: Optional[Dict] = None) -> List:
  """Step seconds of each plan, all built in this process and timed in
  turn, round robin (measuring.RoundRobin): the median of the rounds
  (measuring.Steady), as the calibration and the plan check take a step.

  `built`: None, each plan built here and closed after; else the sessions by
  plan key: one built before (by an earlier call, or earlier in `plans`) is
  timed again (a Lingvo model's build takes seconds to a minute), the new
  ones are added, all left open (CloseAll).
  """
  steps = []
  for p in plans:
    if built is None:
      steps.append(BuildStep(model, p))
      continue
    if p.Key() not in built:
      built[p.Key()] = BuildStep(model, p)
    steps.append(built[p.Key()])
  times = measuring.RoundRobin(
      [lambda s=s: s[0].run(s[1]) for s in steps], rounds, warmup)
  if built is None:
    CloseAll(steps)
  return times if every_round else [measuring.Steady(t) for t in times]


def CloseAll(steps) -> None:
  """Closes each (session, train op), once."""
  for sess, _ in {id(s): s for s in steps}.values():
    sess.close()


def Rss(model: str, plans: Sequence[planner.Plan], measurer) -> List:
  """Peak RSS bytes of each plan, each in a fresh process (2 steps)."""
  out = []
  for p in plans:
    r = measurer.Measure(dict(model=model, plan=p.ToDict(), steps=2,
                              warmup=0))
    out.append(r.get('rss_bytes'))
  return out


# Side by side after the sweep: its fastest few plans timed again beside the
# two choices. The fastest of many plans timed once each is partly luck (the
# least disturbed rounds of plans within a few percent); timed again in one
# round robin with the choices, the ratios compare like with like.
CONFIRM_FASTEST = 5
# Its rounds at least: a few plans, cheap beside their builds.
SIDE_ROUNDS = 20


def RunModel(model: str, devices: int, rounds: int, warmup: int,
             measure_top: int, measurer, micro_batches=None,
             measure_within: float = measuring.MEASURE_WITHIN) -> Dict:
  """Predicts and measures every plan of one model; its summary record."""
  t0 = time.time()
  profile = Profile(model)
  config = (plan_models.FcSessionConfig(devices) if plan_models.FcWidth(model)
            else planner.SessionConfig(devices))
  machine = planner.ProbeMachine(config)
  probe = dataclasses.asdict(machine)
  refs = ReferencePlans(model, profile, devices)
  plans = SweepPlans(model, profile, devices, micro_batches)
  _Log('%s: %d plans; building and timing them (%d rounds)' %
       (model, len(plans), rounds))
  # The references are timed beside the sweep's plans (the same load): their
  # figures calibrate, the sweep's are compared (a reference that is also a
  # sweep plan is one session, timed in both places). The sessions are kept
  # for the --measure and side-by-side timings.
  built = {}
  times = TimePlans(model, refs + plans, rounds, warmup, built=built)
  ref_rss = Rss(model, refs[:2], measurer)
  machine = planner.Calibrate(profile, machine, times[:len(refs)], ref_rss,
                              refs=refs)
  _Log('%s: %.3g FLOP/s, %.2f devices at once, %.1f us per op (x %.2f in '
       'recurrent), %.1f us per hand-off, %.1f us per gate, %.1f ms per '
       'step, %.0f KB per graph op, overhead %s%s' % (
           model, machine.flops_per_s, machine.cores, 1e6 * machine.s_per_op,
           machine.recurrent_op_factor, 1e6 * machine.s_per_handoff,
           1e6 * machine.s_per_gate, 1e3 * machine.step_s,
           machine.bytes_per_op / 1024,
           planner.FormatSize(machine.overhead_bytes),
           '' if machine.s_per_reduced_var is None else
           ', %.1f us per all_reduce variable' % (
               1e6 * machine.s_per_reduced_var)))
  plans = planner.PredictAll(profile, plans, machine)
  plans = [p.Measured(step_s=t, rss_bytes=r) for p, t, r in zip(
      plans, times[len(refs):], Rss(model, plans, measurer))]
  # The peak RSS as the start-up check and the plan check predict it.
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  constants = memory_probe.Get(devices)
  predicted_rss = {p.Key(): round(plan_models.PredictedRss(
      model, profile, p.plan, constants)) for p in plans}
  baseline = measurer.Measure(dict(model=model, devices=devices,
                                   baseline=True)).get('rss_bytes')
  for p in plans:
    _Log('  %-36s predicted %7.1f ms %s, measured %7.1f ms %s' % (
        p.Key(), 1e3 * p.step_s, planner.FormatSize(p.process_bytes),
        1e3 * p.measured_step_s,
        '-' if p.measured_rss_bytes is None else
        planner.FormatSize(p.measured_rss_bytes)))
  ranked = planner.Rank(plans)
  # --measure: the top plans (and their twins without recompute) timed
  # again, round robin, and chosen as the tool chooses
  # (planner.MeasuredChoice); its time below is the sweep's, so both
  # choices compare on one run.
  top = measuring.MeasureCandidates(ranked, measure_top, measure_within)
  again = TimePlans(model, top, rounds, warmup, every_round=True,
                    built=built)
  copies = [p.Measured(times=t) for p, t in zip(top, again)]
  pick, noise = planner.MeasuredChoice(copies)
  chosen_measured = top[[c is pick for c in copies].index(True)]
  fastest = sorted(plans, key=lambda p: p.measured_step_s)
  # And the sweep's fastest plan of one cell and of more: whether cutting
  # pays (where the sweep has both).
  side = [ranked[0], chosen_measured] + fastest[:CONFIRM_FASTEST] + [
      next(p for p in fastest if pred(p.plan.num_cells))
      for pred in (lambda k: k == 1, lambda k: k > 1)
      if any(pred(p.plan.num_cells) for p in fastest)]
  side = list({p.Key(): p for p in side}.values())
  _Log('%s: side by side: %s' % (model, ', '.join(p.Key() for p in side)))
  side_times = TimePlans(model, side, max(rounds, SIDE_ROUNDS), warmup,
                         built=built)
  CloseAll(built.values())
  return plan_report.Summary(
      model, devices, plans, machine,
      dict(chosen_measure_key=chosen_measured.Key(),
           measure_noise=round(noise, 3), measure_top=measure_top,
           measure_within=measure_within,
           measure_candidates=[p.Key() for p in top],
           measure_rounds_ms=[[round(1e3 * x, 3) for x in t] for t in again]),
      side_by_side_ms={p.Key(): round(1e3 * t, 3)
                       for p, t in zip(side, side_times)},
      probe=probe, reference_keys=[p.Key() for p in refs],
      reference_ms=[round(1e3 * t, 3) for t in times[:len(refs)]],
      reference_rss_mb=[round(r / 2**20, 1) for r in ref_rss if r],
      predicted_rss=predicted_rss,
      runtime_mb=round(constants.runtime_bytes / 2**20, 1),
      bench_runtime_mb=baseline and round(baseline / 2**20, 1),
      seconds=round(time.time() - t0))


# --xla: the plans compared with and without XLA-compiled cells, one
# replica, 'unrolled' (the choice is the cells' build, the same for every
# schedule that calls cell functions).
XLA_PLANS = ((1, 1), (2, 2), (2, 4), (2, 8))


def RunXla(model: str, devices: int, rounds: int, warmup: int) -> Dict:
  """XLA's effect predicted (planner.CalibrateXla) against measured.

  The reference plans and XLA's two, and XLA_PLANS (K, M) with jit_compile
  False and True, all timed round robin in one process; the machine
  calibrated on the references; per plan, the predicted and measured
  XLA / no-XLA step ratio and whether the predicted faster build is the
  measured faster one.
  """
  profile = Profile(model)
  config = (plan_models.FcSessionConfig(devices) if model == FC
            else planner.SessionConfig(devices))
  machine = planner.ProbeMachine(config)
  refs = planner.ReferencePlans(profile, devices=1)
  xla_refs = planner.XlaReferencePlans(profile, devices=devices)
  base = [p for p in planner.Enumerate(profile, devices,
                                       schedules=('unrolled',),
                                       sync_choices=('shared',))
          if p.replicas == 1 and not p.recompute and
          (p.num_cells, p.num_micro_batches) in XLA_PLANS]
  pairs = [dataclasses.replace(p, jit_compile=j) for p in base
           for j in (False, True)]
  _Log('%s: %d references, %d plans with and without XLA; building (XLA '
       'compiles) and timing them (%d rounds)' % (
           model, len(refs) + len(xla_refs), len(pairs), rounds))
  times = TimePlans(model, refs + xla_refs + pairs, rounds, warmup)
  n, x = len(refs), len(xla_refs)
  machine = planner.Calibrate(profile, machine, times[:n], refs=refs)
  machine = planner.CalibrateXla(profile, machine, times[n:n + x], xla_refs)
  rows = []
  measured = times[n + x:]
  for i, p in enumerate(base):
    pred = [planner.Predict(profile, pairs[2 * i + j], machine).step_s
            for j in (0, 1)]
    meas = measured[2 * i:2 * i + 2]
    rows.append(dict(plan=p.Key(), predicted_ms=[round(1e3 * t, 3)
                                                  for t in pred],
                     measured_ms=[round(1e3 * t, 3) for t in meas],
                     predicted_ratio=round(pred[1] / pred[0], 3),
                     measured_ratio=round(meas[1] / meas[0], 3),
                     agree=(pred[1] < pred[0]) == (meas[1] < meas[0])))
    _Log('  %-22s XLA / no XLA: predicted %.2f, measured %.2f' % (
        p.Key(), rows[-1]['predicted_ratio'], rows[-1]['measured_ratio']))
  return dict(model=model, devices=devices, xla=True, rows=rows,
              xla_s_per_call=machine.xla_s_per_call,
              xla_s_per_param_byte=machine.xla_s_per_param_byte,
              xla_flop_factor=machine.xla_flop_factor,
              s_per_op=machine.s_per_op, machine=harness.Machine())


def main(argv=None) -> int:
  parser = harness.Parser(__doc__,
                          markdown_help='Print markdown tables instead of '
                          'JSON lines.')
  parser.add_argument('--models', nargs='+', default=list(DEFAULT_MODELS),
                      help='Registered experiments, "fc", "fc256", '
                      '"fc1024", "lingvo_lm", "lingvo_mt" (bench/'
                      'plan_models.py), or "pipelined": %s (default '
                      '%%(default)s).' % ' '.join(PIPELINED_MODELS))
  parser.add_argument('--devices', type=int, default=2,
                      help='CPU devices N (default %(default)s).')
  parser.add_argument('--rounds', type=int, default=measuring.MEASURE_STEPS,
                      help='Timed rounds (one step of each plan per round, '
                      'in turn; the median; default %(default)s).')
  parser.add_argument('--warmup', type=int, default=2,
                      help='Untimed steps first (default %(default)s).')
  parser.add_argument('--measure_top', type=int,
                      default=measuring.MEASURE_TOP,
                      help='At most this many plans the --measure choice '
                      're-times (default %(default)s).')
  parser.add_argument('--measure_within', type=float,
                      default=measuring.MEASURE_WITHIN,
                      help='The --measure choice re-times the plans '
                      'predicted within this fraction of the best (default '
                      '%(default)s).')
  parser.add_argument('--micro_batches', type=int, nargs='+',
                      help='Only plans with these M (default: every M the '
                      'planner offers).')
  parser.add_argument('--xla', action='store_true',
                      help='Instead of the sweep: XLA\'s effect predicted '
                      'against measured (RunXla).')
  parser.add_argument('--jsonl', help='Also append each model\'s record '
                      'to this file as it is done.')
  parser.add_argument('--from_jsonl',
                      help='Only render --markdown from a saved --jsonl.')
  parser.add_argument('--repredict', action='store_true',
                      help='With --from_jsonl: predict the saved run again '
                      'with this checkout\'s planner (its own probe and '
                      'reference measurements calibrated again; see '
                      'Repredict).')
  args = parser.parse_args(argv)
  if args.repredict and not args.from_jsonl:
    parser.error('--repredict needs --from_jsonl.')
  error = entry_point.ParseFlags()  # Lingvo's layers read them as they build.
  if error:
    parser.error(error)
  if args.from_jsonl:
    with open(args.from_jsonl) as f:
      records = [json.loads(l) for l in f if l.strip()]
    if args.repredict:
      records = [plan_report.Repredict(r, Profile, ReferencePlans)
                 for r in records]
    if args.markdown:
      print(plan_report.Markdown(records))
    else:
      for r in records:
        print(json.dumps(r))
    return 0
  if args.devices < 1:
    parser.error('--devices must be >= 1.')
  models = []
  for m in args.models:
    models += list(PIPELINED_MODELS) if m == 'pipelined' else [m]
  error = measuring.TooFewRounds('--rounds', args.rounds, args.measure_top)
  if error:
    parser.error(error)
  # By module path, so the fork server's children find it.
  measurer = measuring.Measurer(
      importlib.import_module('bench.plan').MeasureJob, ['bench.plan'])
  atexit.register(plan_models.Cleanup)
  records = []
  t = time.time()
  for model in models:
    if args.xla:
      records.append(RunXla(model, args.devices, args.rounds, args.warmup))
      print(json.dumps(records[-1]), flush=True)
      continue
    records.append(RunModel(model, args.devices, args.rounds, args.warmup,
                            args.measure_top, measurer, args.micro_batches,
                            args.measure_within))
    if args.jsonl:
      with open(args.jsonl, 'a') as f:
        f.write(json.dumps(records[-1]) + '\n')
    if not args.markdown:
      print(json.dumps(records[-1]), flush=True)
  if args.markdown:
    print(plan_report.XlaMarkdown(records) if args.xla else
          plan_report.Markdown(records))
  _Log('done in %.0f s' % (time.time() - t))
  return 0


if __name__ == '__main__':
  sys.exit(main())
