"""The planner on Lingvo's flagship LM experiment (scaled down).

tests/support/flagship_testlib.py's copy of `OneBWdsGPipeTransformer`
(batch-major: its time axis trimmed to each batch's longest sentence at run
time; `eval.samples_per_summary=0`), planned by `tools.plan` and the trainer's
`--plan=auto`.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from lingvo_ext import planner
from lingvo_ext.pipeline import records
from lingvo_ext.planner import tree
from lingvo_ext.tasks import experiment_params
from lingvo_ext.tools import plan as plan_tool
from tests.support import ROOT
from tests.support import flagship_testlib
from tests.support import zygote

MODEL = flagship_testlib.MODEL
STACK = 'task.lm.stack'
# A fixed machine: the comparisons below are of the model, not the host.
MACHINE = planner.Machine(flops_per_s=1e10, s_per_op=1e-5, cores=2)


flagship = pytest.fixture(scope='module', name='flagship')(
    flagship_testlib.Fixture)


def _Longest(root):
  """The most tokens a Train sentence of the corpus gives (words + </S>)."""
  train = os.path.join(root, 'lm1b', 'training-monolingual.tokenized.shuffled')
  return max(len(line.split()) + 1 for name in os.listdir(train)
             for line in open(os.path.join(train, name)))


def _Json(capsys, *flags):
  rc = plan_tool.main([f'--model={MODEL}', '--devices=2', '--no-calibrate',
                       '--json', *flags])
  out = capsys.readouterr()
  assert rc == 0, out.err[-3000:]
  return json.loads(out.out)


def testPlansTheFlagshipWithTheLengthItReads(flagship, capsys):
  got = _Json(capsys)
  [pipe] = got['pipelines']
  assert pipe['path'] == STACK and pipe['cells'] == 2
  seq = pipe['sequence_length']
  # Read from tree.READ_BATCHES Train batches: each batch's longest sentence,
  # within the corpus's longest and the bucket's bound (48).
  assert len(seq['read']) == tree.READ_BATCHES and not seq['given']
  assert all(2 <= n <= _Longest(flagship) for n in seq['read']), seq
  assert seq['length'] == -(-sum(seq['read']) // len(seq['read']))
  assert seq['maximum'] == 48 and seq['length'] < 48
  # Said in the text output too.
  assert plan_tool.main([f'--model={MODEL}', '--devices=2',
                         '--no-calibrate']) == 0
  out = capsys.readouterr().out
  # (Batches read again, in another order: their lengths may differ.)
  assert re.search(r'sized for sequence length \d+: the mean longest '
                   f'sequence of {tree.READ_BATCHES} Train batches read now',
                   out), out
  assert 'the input allows up to 48' in out


def testTheReadLengthPredictsFasterThanTheBucketMaximum(flagship):
  del flagship
  cfg = planner.ExperimentParams(MODEL)
  [real] = tree.ProfileTree(cfg, MODEL)
  [most] = tree.ProfileTree(cfg, MODEL, length=48)
  assert most.length.given and most.length.length == 48
  assert real.length.length < 48
  # The same cells on a shorter time axis: fewer FLOPs and kept bytes.
  for a, b in zip(real.profile.layers, most.profile.layers):
    assert a.flops < b.flops and a.kept_bytes <= b.kept_bytes
  fast = tree.ChooseTree([real], 2, machine=MACHINE)[0][1][0]
  slow = tree.ChooseTree([most], 2, machine=MACHINE)[0][1][0]
  assert fast.step_s < slow.step_s


def testTheOverrideIsPlannedAndItsTextParsesBackToThePlan(flagship, capsys):
  del flagship
  got = _Json(capsys, "--model_params_override=task.lm.stack.splits:4")
  [pipe] = got['pipelines']
  assert pipe['cells'] == 4
  text = got['model_params_override']
  assert text.startswith('task.lm.stack.splits:4; ')
  assert f"--model_params_override='{text}'" in got['command']
  best = pipe['best']
  cfg = experiment_params.GetParams(MODEL, 'Train', text)
  stack = cfg.task.lm.stack
  assert stack.splits == 4
  assert stack.schedule == best['schedule']
  assert stack.num_micro_batches == best['num_micro_batches']


def testPlanParamsSetsEachPipelinesPlanAsItsOverrideDoes(flagship):
  del flagship
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  built = experiment_params.GetParams(MODEL, 'Train')
  before = built.ToText()
  chosen = auto.PlanParams(built, MODEL, 2, machine=MACHINE)
  assert built.ToText() == before
  [(pipe, plan)] = chosen.plan
  assert pipe.path == STACK
  stack = chosen.params.task.lm.stack
  assert (stack.schedule, stack.num_micro_batches) == (
      plan.schedule, plan.num_micro_batches)
  rebuilt = experiment_params.GetParams(MODEL, 'Train', chosen.override)
  assert chosen.params.ToText() == rebuilt.ToText()


def testNoPlanTheBuilderRefuses(flagship, capsys):
  del flagship
  for override in ('task.lm.stack.splits:2', 'task.lm.stack.splits:4'):
    got = _Json(capsys, f'--model_params_override={override}')
    [pipe] = got['pipelines']
    offered = pipe['plans']
    assert offered
    for p in offered:
      # The time axis is trimmed at run time: Lingvo's loop cannot run it.
      assert p['schedule'] != 'recurrent', p
      assert records.Refusal(p['schedule'], p['num_cells'],
                             p['devices_per_replica'],
                             p['num_micro_batches'],
                             static_shapes=False) is None, p


def testSplitsBeyondTheLayersAreRefusedNamingTheEmptyCells(flagship, capsys):
  del flagship
  rc = plan_tool.main([f'--model={MODEL}', '--devices=2', '--no-calibrate',
                       '--model_params_override=task.lm.stack.splits:8'])
  out = capsys.readouterr()
  assert rc == 2 and not out.out
  [line] = out.err.strip().splitlines()[-1:]
  # The pipeline's own refusal (when the planner builds it) or the
  # planner's, from the cells it profiled: one line naming the cells.
  assert line.startswith('error: '), line
  assert 'cells cell_4, cell_5, cell_6 hold no layer (8 cells' in line, line


def testXlaIsRefusedForPipelinesThatComeCutInOneLine(flagship, capsys):
  del flagship
  rc = plan_tool.main([f'--model={MODEL}', '--devices=2', '--xla'])
  out = capsys.readouterr()
  assert rc == 2 and not out.out
  [line] = out.err.strip().splitlines()[-1:]
  assert line == (f'error: --xla plans PipelinedTask experiments; --model='
                  f'{MODEL} holds its pipelines already cut: leave --xla out '
                  "(their jit_compile is the trainer's --jit_compile).")


def testABadOverrideIsOneLine(flagship, capsys):
  del flagship
  rc = plan_tool.main([f'--model={MODEL}', '--devices=2',
                       '--model_params_override=task.lm.stack.splitz:4'])
  out = capsys.readouterr()
  assert rc == 2 and not out.out
  line = out.err.strip().splitlines()[-1]
  assert line.startswith('error: ') and 'splitz' in line, out.err


@pytest.mark.e2e
def testTrainerPlanAutoRunsTheFlagship(flagship, tmp_path):
  logdir = tmp_path / 'auto'
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={MODEL}',
       f'--logdir={logdir}', '--plan=auto', '--devices=2', '--max_steps=2',
       "--model_params_override=task.lm.stack.splits:4"],
      cwd=ROOT, env=flagship_testlib.Env(flagship), stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, timeout=600, check=False)
  out = proc.stdout
  assert proc.returncode == 0, out[-4000:]
  [chose] = [l for l in out.splitlines() if '--plan=auto chose' in l]
  assert '(sized for sequence length ' in chose
  assert "--model_params_override='task.lm.stack.splits:4; " in chose
  assert 'Train batches read now' in chose
  assert out.count('overriding:') <= 1, out
  assert os.path.exists(os.path.join(logdir, 'train'))


def testTheTimeMajorFlagshipIsRefusedInOneLine(flagship, capsys):
  del flagship
  rc = plan_tool.main([f'--model={flagship_testlib.TIME_MAJOR_MODEL}',
                       '--devices=2', '--no-calibrate'])
  out = capsys.readouterr()
  assert rc == 2 and not out.out
  line = out.err.strip().splitlines()[-1]
  assert line.startswith('error: task 1bwds_wpm_level_lm '
                         '(FixedShapeInputLanguageModel) feeds task.lm'), line
  assert 'BatchMajorLanguageModel' in line


def testAnUnreadableInputIsOneLineNamingIt(flagship, capsys):
  del flagship
  rc = plan_tool.main([
      f'--model={MODEL}', '--devices=2', '--no-calibrate',
      '--model_params_override=input.tokenizer.token_vocab_filepath:'
      '/nonexistent/vocab.txt'])
  out = capsys.readouterr()
  assert rc == 2 and not out.out
  line = out.err.strip().splitlines()[-1]
  assert line.startswith('error: input 1bwds_train_set: reading a batch for '
                         'its sequence lengths failed: '), line
  assert '/nonexistent/vocab.txt' in line and line.endswith(
      'fix its files or tokenizer params.'), line


# A machine whose step times stand in for the timed references'.
TRUE_MACHINE = planner.Machine(flops_per_s=3e9, s_per_op=4e-5, cores=2,
                               step_s=6e-3)


def _StandInCalibration(monkeypatch, calls):
  from lingvo_ext.planner import tree_calibration  # pylint: disable=g-import-not-at-top

  def Times(model, model_params, pipes, refs, rounds=None):
    del model, model_params, rounds
    calls.append(len(refs))
    return [planner.Predict(pipes[0].profile, r, TRUE_MACHINE).step_s
            for r in refs]

  monkeypatch.setattr(tree_calibration, 'TimeReferences', Times)
  return tree_calibration


def testTheTreeIsCalibratedOnItsOwnCellsAndCached(flagship, monkeypatch,
                                                   tmp_path):
  del flagship
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  calls = []
  tc = _StandInCalibration(monkeypatch, calls)
  cfg = planner.ExperimentParams(MODEL)
  pipes = tree.ProfileTree(cfg, MODEL)
  refs = tc.ReferencePlans(pipes[0])
  # Its cells as cut, on one device; Lingvo's loop refused on a time axis
  # trimmed at run time.
  assert [(r.schedule, r.num_cells, r.devices_per_replica) for r in refs] == [
      ('unrolled', 2, 1), ('unrolled', 2, 1)]
  assert refs[0].num_micro_batches == 1 < refs[1].num_micro_batches
  probed = planner.Machine(flops_per_s=2e10, s_per_op=1e-6, cores=2,
                           step_s=1e-4)
  got = tc.Calibrate(MODEL, cfg, pipes, 2, machine=probed)
  assert calls == [2]
  # The fitted machine predicts the references as measured.
  for r in refs:
    want = planner.Predict(pipes[0].profile, r, TRUE_MACHINE).step_s
    assert planner.Predict(pipes[0].profile, r, got).step_s == pytest.approx(
        want, rel=1e-6)
  # Cached: the same fit, nothing timed.
  assert tc.Calibrate(MODEL, cfg, pipes, 2, machine=probed) == got
  assert calls == [2]
  tc.Calibrate(MODEL, cfg, pipes, 2, machine=probed, recalibrate=True)
  assert calls == [2, 2]
  # --plan=auto's tree path ranks with it.
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(tc, 'Calibrate',
                      lambda *a, **k: calls.append('fit') or got)
  [(pipe, ranked)] = auto.ChooseTreeForExperiment(cfg, MODEL, 2)
  assert calls[-1] == 'fit'
  assert ranked[0].step_s == pytest.approx(
      planner.Predict(pipe.profile, ranked[0].plan, got).step_s)


@pytest.mark.slow
def testTheTreeReferencesBuildAndRun(flagship):
  del flagship
  from lingvo_ext.planner import tree_calibration  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams(MODEL)
  pipes = tree.ProfileTree(cfg, MODEL)
  refs = tree_calibration.ReferencePlans(pipes[0])
  times = tree_calibration.TimeReferences(MODEL, cfg, pipes, refs, rounds=1)
  assert len(times) == len(refs) and all(t > 0 for t in times)


def testPlanAutoCountsTheTaskOutsideItsPipelinesInTheMemory(flagship,
                                                            monkeypatch):
  # The task's ops outside its stack (the loss, the input's, the global
  # step's) come with every plan of the stack: --plan=auto counts them.
  del flagship
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import input_memory  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tree_memory  # pylint: disable=g-import-not-at-top
  cfg = planner.ExperimentParams(MODEL)
  constants = memory_model.Constants(runtime_bytes=5e8,
                                     activation_factor=1., bytes_per_op=3e4)
  seen = []
  real = auto._FittingTree  # pylint: disable=protected-access

  def Fitting(ranked, constants, available, source, rest=0.):
    seen.append(rest)
    return real(ranked, constants, available, source, rest)

  monkeypatch.setattr(auto, '_FittingTree', Fitting)
  auto.PlanParams(cfg, MODEL, 2, machine=MACHINE, available=64 * 2.**30,
                  constants=constants)
  terms = tree_memory.OtherTerms(tree_memory.ProfileTaskMemory(cfg, MODEL),
                                 constants.bytes_per_op)
  assert terms['graph'] > 0
  assert seen == [pytest.approx(input_memory.RunBufferBytes(cfg) +
                                sum(terms.values()))]
