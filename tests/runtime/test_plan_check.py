"""The `plan check:` line: its format, once when steady, its error lines.

A fake clock and stand-in figures: no test here times anything.
"""

import glob
import os
import re

import lingvo.compat as tf

from lingvo_ext import planner
from lingvo_ext.planner import machine_cache
from lingvo_ext.runtime import plan_check
from lingvo_ext.runtime import plan_prediction
from lingvo_ext.runtime import trainer_flags

MB = 2**20
LINE = re.compile(r'^plan check: step \d+\.\d ms, predicted \d+\.\d ms '
                  r'\((?:[+-]\d+|0)%\); peak memory \d+ MB, predicted \d+ MB '
                  r'\((?:[+-]\d+|0)%\)$')
PREDICTED = plan_check.Predicted(
    step_s=0.0395, rss_bytes=1050 * MB,
    step_terms=(('the time per op (s_per_op)', 0.030),
                ('the fixed time of a step', 0.0095)),
    rss_terms=(('the process baseline', 800 * MB),
               ('the kept activations', 250 * MB)),
    recalibrate='.venv/bin/python -m lingvo_ext.tools.plan --model=m '
    '--devices=2 --recalibrate')


def testTheLineAsTheIssueWritesIt():
  line = plan_check.Line(0.0412, 1104 * MB, PREDICTED)
  assert line == ('plan check: step 41.2 ms, predicted 39.5 ms (-4%); peak '
                  'memory 1104 MB, predicted 1050 MB (-5%)')
  assert LINE.match(line)
  assert plan_check.OffLines(0.0412, 1104 * MB, PREDICTED) == []


def testAPredictionAboveTheMeasurementIsPlus():
  line = plan_check.Line(0.030, 1050 * MB, PREDICTED)
  assert '(+32%)' in line and 'predicted 1050 MB (0%)' in line, line
  assert LINE.match(line)


def testOffByMoreThanAQuarterNamesTheLargestTermAndTheCommand():
  # The step 2x the prediction (-51%), the memory within 25%.
  lines = plan_check.OffLines(0.080, 1200 * MB, PREDICTED)
  assert lines == [
      'plan check: the step is predicted 51% low; its largest term is the '
      'time per op (s_per_op) (30.0 ms of 39.5 ms); recalibrate with: '
      '.venv/bin/python -m lingvo_ext.tools.plan --model=m --devices=2 '
      '--recalibrate.']
  # Both off: a line each, the memory's naming its own largest term.
  lines = plan_check.OffLines(0.020, 700 * MB, PREDICTED)
  assert len(lines) == 2
  assert lines[0].startswith('plan check: the step is predicted 98% high')
  assert lines[1].startswith(
      'plan check: the peak memory is predicted 50% high; its largest term '
      'is the process baseline (800 MB of 1050 MB)')
  # Exactly 25% off is not more than 25%.
  assert plan_check.OffLines(0.0395 / 0.75, 1050 * MB, PREDICTED) == []


class _Clock:

  def __init__(self, step_s):
    self.now, self.step_s = 0., step_s

  def __call__(self):
    self.now += self.step_s
    return self.now


def _Check(predicted, steps, seconds, clock):
  got = []
  check = plan_check.PlanCheck(
      predicted, plan_check.Thresholds(steps, seconds),
      emit=lambda lines, scalars, step: got.append((lines, scalars, step)),
      clock=clock, rss=lambda: 1104. * MB)
  return check, got


def testPrintedOnceWhenBothThresholdsAreReached():
  check, got = _Check(PREDICTED, 10, 3., _Clock(0.25))
  printed = [s for s in range(1, 100) if check.Ran(s)]
  # 10 steps take 2.5 s: the 3 s come later (12 intervals after the first).
  assert printed == [13] and len(got) == 1
  lines, scalars, step = got[0]
  assert step == 13 and len(lines) == 2 and LINE.match(lines[0])
  assert lines[0].startswith('plan check: step 250.0 ms, predicted 39.5 ms')
  assert scalars['plan_check/step_ms'] == 250.
  assert abs(scalars['plan_check/step_error'] - (0.0395 / 0.25 - 1)) < 1e-9
  assert scalars['plan_check/peak_memory_mb'] == 1104.


def testTheStepIsTheMedianOfTheLastSteps():
  times = iter([0., 5.] + [5. + 0.01 * i for i in range(1, 20)])
  check, got = _Check(PREDICTED, 10, 0., lambda: next(times))
  for s in range(1, 21):
    check.Ran(s)
  # The 5 s first interval (a build, a compile) is not among the last 10.
  assert got and got[0][0][0].startswith('plan check: step 10.0 ms')


def testAShortRunPrintsNothing():
  check, got = _Check(PREDICTED, 50, 30., _Clock(0.1))
  for s in range(1, 200):  # 200 steps, 20 s: not steady by 30 s.
    check.Ran(s)
  assert not got and not check.done


def testCountedFromThePredictionsArrival():
  ready = {'at': 30}
  steps = {'n': 0}

  def Predicted():
    return PREDICTED if steps['n'] >= ready['at'] else None

  check, got = _Check(Predicted, 5, 0., _Clock(0.1))
  for s in range(1, 40):
    steps['n'] = s
    if check.Ran(s):
      break
  assert got and got[0][2] == 35  # Ready at 30, then 5 intervals.


class _Late:
  """A prediction still running at the run's end; Wait gives it."""

  def __init__(self, predicted):
    self.predicted, self.waited = predicted, 0

  def __call__(self):
    return None

  def Wait(self):
    self.waited += 1
    return self.predicted


def testALongRunWhosePredictionCameLatePrintsOnceAtItsEnd():
  late = _Late(PREDICTED)
  check, got = _Check(late, 10, 3., _Clock(0.25))
  assert not any(check.Ran(s) for s in range(1, 41))  # Never ready.
  lines = check.Finish()
  assert late.waited == 1 and len(got) == 1 and got[0][2] == 40
  assert lines[0].startswith('plan check: step 250.0 ms, predicted 39.5 ms')
  assert check.Finish() is None and len(got) == 1  # Once.


def testAShortRunPrintsNothingAtItsEndEither():
  late = _Late(PREDICTED)
  check, got = _Check(late, 50, 30., _Clock(0.1))
  for s in range(1, 100):  # 10 s: not steady by 30 s.
    check.Ran(s)
  assert check.Finish() is None and not got and late.waited == 0


def testAFailedPredictionPrintsNothing():
  check, got = _Check(lambda: False, 1, 0., _Clock(0.1))
  for s in range(1, 10):
    check.Ran(s)
  assert not got and check.done


def testEmitWritesTheLineAndTheScalars(tmp_path, capsys):
  plan_check.Emit(['plan check: x'], {'plan_check/step_ms': 41.2}, 7,
                  summary_dir=str(tmp_path))
  assert capsys.readouterr().out == 'plan check: x\n'
  [events] = glob.glob(os.path.join(tmp_path, 'events.out.*'))
  got = [(e.step, v.tag, v.simple_value)
         for e in tf.train.summary_iterator(events) for v in e.summary.value]
  assert got == [(7, 'plan_check/step_ms', 41.20000076293945)]


def testARunShorterThanTheThresholdStartsNoPrediction():
  o = trainer_flags.Options(model='lm.TransformerLmTiny', plan_check_steps=50)
  assert plan_prediction.Start(o, 49) is None
  o = trainer_flags.Options(model='lm.TransformerLmTiny', plan_check_steps=0)
  assert plan_prediction.Start(o, 1000) is None


def testTheRecalibrationCommandIsToolsPlans():
  assert plan_prediction.RecalibrateCommand('lm.X', 2, 'task.a:1') == (
      ".venv/bin/python -m lingvo_ext.tools.plan --model=lm.X --devices=2 "
      "--model_params_override='task.a:1' --recalibrate")
  args = ['--model=lm.X', '--devices=2', '--recalibrate']
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  assert plan_tool._ParseArgs(args).recalibrate  # pylint: disable=protected-access


def testPredictedRoundTripsThroughItsDict():
  assert plan_check.Predicted.FromDict(PREDICTED.ToDict()) == PREDICTED


def testTheMachineCacheKeepsACalibrationPerKey(tmp_path):
  path = str(tmp_path / 'calibration.json')
  layer = planner.LayerProfile('l', 1e6, 10, 20, 400, 2, 64., 64.)
  profile = planner.ModelProfile('m', (layer, layer), batch=8, in_bytes=64.)
  refs = planner.ReferencePlans(profile)
  key = machine_cache.Key(profile, 2, refs, 'host')
  assert key != machine_cache.Key(profile, 1, refs, 'host')
  assert key != machine_cache.Key(
      planner.ModelProfile('m', (layer,), batch=8, in_bytes=64.), 2, refs,
      'host')
  calls = []
  fitted = planner.Machine(s_per_op=3e-6, step_s=1e-3)

  def Fit():
    calls.append(1)
    return fitted

  assert machine_cache.Cached(key, Fit, path=path) == fitted
  assert machine_cache.Cached(key, Fit, path=path) == fitted
  assert len(calls) == 1
  machine_cache.Cached(key, Fit, recalibrate=True, path=path)
  assert len(calls) == 2
  assert machine_cache.Read('other', path) is None


def testTrainingDoesNotWaitForThePrediction(monkeypatch):
  import threading  # pylint: disable=g-import-not-at-top
  release = threading.Event()

  def Run(self, job, timeout_s):
    release.wait(60)
    self._result = PREDICTED  # pylint: disable=protected-access

  monkeypatch.setattr(plan_prediction.Pending, '_Run', Run)
  pending = plan_prediction.Pending({})
  assert pending() is None  # Not ready: the step goes on.
  assert not pending.Calibrating()
  release.set()
  pending._thread.join(60)  # pylint: disable=protected-access
  assert pending() == PREDICTED


def testAColdCalibrationHoldsTheStepsUntilAStop(monkeypatch):
  import threading  # pylint: disable=g-import-not-at-top
  release = threading.Event()

  def Run(self, job, timeout_s):
    open(job['calibrating'], 'w').close()  # What PredictJob does on a miss.
    release.wait(60)

  monkeypatch.setattr(plan_prediction.Pending, '_Run', Run)
  stop = threading.Event()
  pending = plan_prediction.Pending({}, stop=stop)
  for _ in range(600):
    if pending.Calibrating():
      break
    threading.Event().wait(0.05)
  assert pending.Calibrating()
  stop.set()
  assert pending() is False  # A run told to stop does not wait.
  release.set()


def testTheCalibrationCacheIsKeyedByTheFit(monkeypatch):
  layer = planner.LayerProfile('l', 1e6, 10, 20, 400, 2, 64., 64.)
  profile = planner.ModelProfile('m', (layer,), batch=8, in_bytes=64.)
  refs = planner.ReferencePlans(profile)
  key = machine_cache.Key(profile, 2, refs, 'host')
  monkeypatch.setattr(machine_cache, 'FIT', 'least of rounds')
  assert machine_cache.Key(profile, 2, refs, 'host') != key


def testTheLoopTermIsTheRunsOwnWhereItTimesItsSessionRuns():
  predicted = plan_check.Predicted(
      step_s=0.007, rss_bytes=1050 * MB, loop_s=0.001,
      step_terms=(('the time per op (s_per_op)', 0.006),
                  (plan_check.PROBED_LOOP_TERM, 0.001)))
  check, got = _Check(predicted, 10, 0., _Clock(0.010))
  for s in range(1, 30):  # Steps 10 ms apart, their Session.run 6 ms.
    check.Ran(s, run_s=0.006)
  lines, scalars, _ = got[0]
  # The 6 ms predicted for the Session.run, plus the run's 4 ms between.
  assert lines == ['plan check: step 10.0 ms, predicted 10.0 ms (0%); peak '
                   'memory 1104 MB, predicted 1050 MB (-5%)']
  assert abs(scalars['plan_check/predicted_step_ms'] - 10.) < 1e-9
  fixed = plan_check.WithMeasuredLoop(predicted, 0.010, 0.006)
  assert [t[0] for t in fixed.step_terms] == [
      'the time per op (s_per_op)', plan_check.LOOP_TERM]
  assert abs(sum(t[1] for t in fixed.step_terms) - fixed.step_s) < 1e-12
  # Without Session.run times (e.g. a launcher's task) the probe's stays.
  check, got = _Check(predicted, 10, 0., _Clock(0.010))
  for s in range(1, 30):
    check.Ran(s)
  assert 'predicted 7.0 ms' in got[0][0][0]


def testTheSteadyStepIsTheMedianOfFiveRunsMeans():
  # A bucketed input: short and long batches; one slow step (a save).
  times = [0.005, 0.015] * 15
  times[3] = 2.
  assert abs(plan_check.Steady(times) - 0.010) < 1e-12
  assert abs(plan_check.Steady([0.004, 0.008]) - 0.006) < 1e-12
  check, got = _Check(PREDICTED, 30, 0., iter(
      [0.] + list(__import__('itertools').accumulate(
          [0.005, 0.015] * 20))).__next__)
  for s in range(1, 42):
    check.Ran(s)
  assert got[0][0][0].startswith('plan check: step 10.0 ms')
