"""Tests of bench/pipeline.py (--quick at tiny sizes),
lingvo_ext/tracing/step_trace.py and the torch-free parts of
bench/torch_baselines.py."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from tensorflow.core.framework import step_stats_pb2
from tensorflow.tsl.profiler.protobuf import trace_events_pb2

from lingvo_ext.tracing import step_trace
from tests.support import ROOT as _REPO
from tests.support import zygote


def _Node(dev, name, start, dur, op='MatMul'):
  n = dev.node_stats.add()
  n.node_name = name
  n.all_start_micros = start
  n.op_end_rel_micros = dur
  n.all_end_rel_micros = dur
  n.timeline_label = '%s = %s(x, y)' % (name, op)
  return n


def _HandMadeStepStats():
  """Two devices over [100, 200) us.

  CPU:0 is busy [100, 130) and [140, 170) (two overlapping ops count once),
  CPU:1 [130, 160) and [190, 200). A call op spanning everything and a
  receive are containers/waits and must not count.
  """
  ss = step_stats_pb2.StepStats()
  d0 = ss.dev_stats.add()
  d0.device = '/job:localhost/replica:0/task:0/device:CPU:0'
  _Node(d0, 'd0_mb0/fc0/MatMul', 100, 30)
  _Node(d0, 'gradients/d0_mb1/fc0/MatMul_grad/MatMul', 140, 20)
  _Node(d0, 'gradients/d0_mb1/fc0/MatMul_grad/MatMul_1', 150, 20)
  _Node(d0, 'StatefulPartitionedCall', 100, 100, op='StatefulPartitionedCall')
  d1 = ss.dev_stats.add()
  d1.device = '/job:localhost/replica:0/task:0/device:CPU:1'
  _Node(d1, 'd1_mb0/fc1/MatMul', 130, 30)
  _Node(d1, 'AssignSubVariableOp', 190, 10, op='AssignSubVariableOp')
  _Node(d1, 'd1_mb0/_Recv', 100, 30, op='_Recv')
  return ss


def testBusyIntervalsAndIdleFraction():
  intervals = step_trace.BusyIntervals(_HandMadeStepStats())
  assert sorted(intervals) == ['CPU:0', 'CPU:1']
  assert intervals['CPU:0'] == [(100.0, 130.0, 'fwd:mb0'),
                                (140.0, 160.0, 'bwd:mb1'),
                                (150.0, 170.0, 'bwd:mb1')]
  assert intervals['CPU:1'] == [(130.0, 160.0, 'fwd:mb0'),
                                (190.0, 200.0, 'update')]
  assert step_trace.Span(intervals) == (100.0, 200.0)
  # Busy: CPU:0 30 + 30, CPU:1 30 + 10 = 100 of 2 x 100.
  assert step_trace.IdleFraction(intervals) == pytest.approx(0.5)
  # Window [100, 150): CPU:0 30 + 10, CPU:1 20 = 60 of 100.
  assert step_trace.IdleFraction(intervals, 100, 150) == pytest.approx(0.4)
  assert step_trace.IdleFraction({}) == 0.0


def testClassify():
  assert step_trace.Classify('d1_mb3/fc2/MatMul', 'MatMul') == 'fwd:mb3'
  assert step_trace.Classify('gradients/d1_mb12/fc2/MatMul_grad/MatMul',
                           'MatMul') == 'bwd:mb12'
  assert step_trace.Classify('gradients/IdentityN_grad/While', 'While') == 'bwd'
  assert step_trace.Classify('While', 'While') == 'fwd'
  assert step_trace.Classify('fc0/Relu', 'ReluGrad') == 'bwd'
  assert step_trace.Classify('AssignSubVariableOp_3',
                           'AssignSubVariableOp') == 'update'
  assert step_trace.OpType('a/b = MatMul(x, y)') == 'MatMul'
  assert step_trace.ShortDevice(
      '/job:w/replica:0/task:0/device:CPU:1') == 'CPU:1'


def testHostBreakdown():
  trace = trace_events_pb2.Trace()
  dev = trace.devices[1]
  dev.name = '/host:CPU'
  dev.resources[7].name = 'tf_Compute/1'
  dev.resources[8].name = 'python'
  for start, dur, long_name in [(0, 10, 'fc0/MatMul:MatMul'),
                                (10, 5, 'acc/InplaceUpdate:InplaceUpdate'),
                                (20, 20, 'gradients/fc0/x:MatMul')]:
    e = trace.trace_events.add()
    e.device_id, e.resource_id = 1, 7
    e.timestamp_ps, e.duration_ps = start * 10**6, dur * 10**6
    e.args['long_name'] = long_name
  e = trace.trace_events.add()  # Not on a compute thread: ignored.
  e.device_id, e.resource_id, e.duration_ps = 1, 8, 10**9
  e.args['long_name'] = 'x:MatMul'
  events = step_trace.HostOpEvents(trace)
  assert len(events) == 3
  b = step_trace.HostBreakdown(events)
  assert b['span_us'] == pytest.approx(40)
  assert b['thread_idle_fraction'] == pytest.approx(5 / 40)
  assert b['category_us'] == {'compute': 30, 'accumulate/state': 5}
  assert b['phase_us'] == {'bwd': 20, 'fwd': 15}
  chrome = step_trace.HostTraceToChrome(trace)
  assert sum(e['ph'] == 'X' for e in chrome['traceEvents']) == 4


def testPlotGantt(tmp_path):
  intervals = step_trace.BusyIntervals(_HandMadeStepStats())
  path = str(tmp_path / 'g.png')
  idle = step_trace.PlotGantt(intervals, path, title='hand-made')
  assert idle == pytest.approx(0.5)
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def testIdealMs():
  from bench import pipeline_step  # pylint: disable=g-import-not-at-top
  assert pipeline_step.IdealMs(100.0, 1, 8) == 100.0
  assert pipeline_step.IdealMs(100.0, 2, 1) == pytest.approx(100.0 * 4 / 3)
  assert pipeline_step.IdealMs(120.0, 2, 4) == pytest.approx(120.0 * 5 / 8 * 4 / 3)


def testTraceStep(tmp_path):
  from bench import pipeline_report  # pylint: disable=g-import-not-at-top
  from bench import pipeline_step  # pylint: disable=g-import-not-at-top
  step = pipeline_step.Step('lingvo_ext', 'homogeneous', width=8, batch=4,
                       num_cells=2, num_micro=2)
  try:
    stats = pipeline_report.TraceStep(step, str(tmp_path), 'ext', 'ext K=2 M=2')
  finally:
    step.Close()
  for suffix in ('.trace.json', '.png'):
    assert os.path.getsize(str(tmp_path / ('ext' + suffix))) > 0
  with open(str(tmp_path / 'ext.trace.json')) as f:
    assert json.load(f)['traceEvents']
  assert 0.0 <= stats['idle_fraction'] < 1.0
  assert sorted(stats['busy_ms']) == ['CPU:0', 'CPU:1']


@pytest.mark.e2e
def testQuickJson():
  from bench import pipeline  # pylint: disable=g-import-not-at-top
  # The --quick sweep: both models, K in (1, 2), M in (1, 4), Lingvo's,
  # lingvo_ext's default and '1f1b' beside the plain model.
  args = pipeline.ParseArgs(['--quick', '--torch_python', 'none'])
  assert (args.models, args.K, args.M) == (['homogeneous', 'heterogeneous'],
                                           [1, 2], [1, 4])
  assert pipeline.Pipelines(args) == ['lingvo', 'lingvo_ext',
                                      'lingvo_ext/1f1b']
  # Run at M=4 only (M=1 takes no path of its own in the bench): every model, K
  # (K=1 is a path of its own) and implementation, half the configurations.
  out = zygote.run(
      [sys.executable, '-m', 'bench.pipeline', '--quick',
       '--M', '4', '--width', '16', '--batch', '8', '--check',
       '--torch_python', 'none'],
      capture_output=True, text=True, timeout=600, cwd=_REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  records = [json.loads(l) for l in out.stdout.splitlines() if l.strip()]
  keys = {(r['impl'], r['model'], r['K'], r['M']) for r in records}
  assert keys == {(i, m, k, mb)
                  for i in ('lingvo', 'lingvo_ext', 'plain',
                            'lingvo_ext/1f1b')
                  for m in ('homogeneous', 'heterogeneous')
                  for k in (1, 2) for mb in (4,)}
  for r in records:
    assert r['step_ms'] > 0, r
    assert r['peak_rss_mb'] > 0, r
    assert r['steps'] >= 10, r
    assert r['loss_rel_diff'] <= 1e-4, r
    assert r['ideal_ms'] > 0 and r['vs_plain'] > 0, r
    if r['impl'].startswith('lingvo_ext'):
      assert r['vs_lingvo'] > 0 and r['vs_unrolled'] > 0, r
    if r['impl'] == 'lingvo_ext/1f1b':
      assert r['ext_params']['schedule'] == "'1f1b'", r
  hetero = [r for r in records if r['model'] == 'heterogeneous' and r['K'] == 2]
  assert all(r['cell_cost_max_over_mean'] > 1.0 for r in hetero)


def testMatmulBenchReportsBothDtypesAndTheCpu():
  from bench import matmul  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core import precision  # pylint: disable=g-import-not-at-top
  records = matmul.Measure(width=32, batch=8, steps=2)
  assert [r['dtype'] for r in records] == ['float32', 'bfloat16']
  # Relations that hold under any load: a rate is a positive finite float,
  # the ratio is the two rates'.
  assert all(isinstance(r['gflops'], float) and 0 < r['gflops'] < math.inf
             for r in records), records
  assert records[0]['vs_float32'] == 1.0
  assert records[1]['vs_float32'] == pytest.approx(
      records[1]['gflops'] / records[0]['gflops'], rel=2e-3)
  assert all(r['onednn'] == precision.OneDnnEnabled() and
             r['cpu_bf16_units'] == precision.CpuHasBf16Units()
             for r in records)
  table = matmul.Markdown(records).splitlines()
  assert len(table) == 4 and '| bfloat16 |' in table[3]
  with pytest.raises(SystemExit):
    matmul.main(['--steps', '0'])


# --- torch baselines: only what runs without torch ----------------------------


def testTorchPythonMissingIsANoteNotACrash(tmp_path):
  from bench import pipeline  # pylint: disable=g-import-not-at-top
  python, note = pipeline.TorchPython(None, default=str(tmp_path / 'python'))
  assert python is None
  assert 'skipped' in note and 'scripts/torch_venv.sh' in note
  assert pipeline.TorchPython('none')[0] is None
  fake = tmp_path / 'python'
  fake.write_text('')
  fake.chmod(0o755)
  assert pipeline.TorchPython(None, default=str(fake))[0] == str(fake)


def testBadTorchPythonIsAOneLineError(capsys):
  from bench import pipeline  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit):
    pipeline.ParseArgs(['--torch_python', '/nonexistent/python'])
  assert '--torch_python /nonexistent/python' in capsys.readouterr().err


def testTorchBaselinesWithoutTorchSaysHowToGetIt():
  # sys.modules['torch'] = None makes `import torch` fail even where torch is
  # installed: this never runs torch.
  script = os.path.join(_REPO, 'bench', 'torch_baselines.py')
  out = subprocess.run(
      [sys.executable, '-c',
       'import runpy, sys; sys.modules["torch"] = None; sys.argv = [%r]; '
       'runpy.run_path(%r, run_name="__main__")' % (script, script)],
      capture_output=True, text=True, timeout=120, cwd=_REPO)
  assert out.returncode == 2, out.stderr[-2000:]
  assert 'torch is not installed' in out.stderr
  assert 'scripts/torch_venv.sh' in out.stderr


def testTorchJobs():
  from bench import torch_baselines  # pylint: disable=g-import-not-at-top
  from bench import torch_common  # pylint: disable=g-import-not-at-top
  args = torch_baselines.ParseArgs(['--K', '1', '2', '--M', '1', '4'])
  jobs = [(j['impl'], j['K'], j['M'], bool(j.get('skip')))
          for j in torch_common.Jobs(args)]
  assert jobs == [('torch/plain', 1, 1, False),
                  ('torch/gpipe', 2, 1, False), ('torch/1f1b', 2, 1, True),
                  ('torch/gpipe', 2, 4, False), ('torch/1f1b', 2, 4, False)]
  assert torch_common.Threads(2, 2) == 1
  assert torch_common.Threads(2, 4) == 1
  with pytest.raises(SystemExit):
    torch_baselines.ParseArgs(['--K', '3'])  # 8 layers in 3 stages.


def testPlainWeightsGiveTheTorchModelTheSameLoss(tmp_path):
  """The weights handed to torch, run as torch_baselines builds the model
  (relu(x w + b) per layer, per-example sum of squares, summed), in numpy:
  the loss equals the TensorFlow plain model's."""
  from bench import pipeline  # pylint: disable=g-import-not-at-top
  from bench import pipeline_step  # pylint: disable=g-import-not-at-top
  from bench import torch_common  # pylint: disable=g-import-not-at-top
  step = pipeline_step.Step('plain', 'homogeneous', width=8, batch=4, num_cells=1,
                       num_micro=1)
  try:
    tf_loss = step.FirstLoss()
    path = str(tmp_path / 'init.npz')
    pipeline.SavePlainWeights(step, path)
  finally:
    step.Close()
  weights = torch_common.InitialWeights(8, pipeline_step.NUM_LAYERS, path)
  y = torch_common.Input(4, 8).astype(np.float64)
  for w, b in weights:
    y = np.maximum(y @ w + b, 0.0)
  assert float((y**2).sum(axis=1).sum()) == pytest.approx(tf_loss, rel=1e-5)


def testMarkdownVsTorch():
  from bench import pipeline_report  # pylint: disable=g-import-not-at-top
  from bench import torch_common  # pylint: disable=g-import-not-at-top

  def Rec(impl, k, m, ms, **kw):
    return dict(impl=impl, model='homogeneous', K=k, M=m, step_ms=ms, **kw)

  torch_kw = dict(framework='torch', p25_ms=1.0, p75_ms=2.0, processes=2,
                  threads_per_process=1, first_loss=3.0, peak_rss_mb=100.0)
  records = [Rec('plain', 2, 4, 100.0), Rec('lingvo_ext', 2, 4, 120.0),
             Rec('torch/plain', 1, 1, 110.0, **torch_kw),
             Rec('torch/gpipe', 2, 4, 240.0, **torch_kw),
             Rec('torch/1f1b', 2, 4, 200.0, **torch_kw)]
  torch_common.AddRatios(records)
  assert records[3]['vs_torch_plain'] == pytest.approx(240 / 110, rel=1e-3)
  rows = pipeline_report.MarkdownVsTorch(records).splitlines()
  assert len(rows) == 3
  assert rows[2] == ('| homogeneous | 2 | 4 | 120.0 | 100.0 | 110.0 | 240.0 '
                     '| 200.0 | 1.20 | 1.09 | 0.50 | 0.60 |')
  assert len(torch_common.Markdown(records).splitlines()) == 5


def test_transformer_keeps_its_own_defaults_unless_given():
  # --models transformer: K, M and steps default to (2, 4), (4, 16) and 5
  # steps unless given on the command line (the FC sweep's defaults would
  # fill them otherwise).
  from bench import pipeline  # pylint: disable=g-import-not-at-top
  args = pipeline.ParseArgs(['--models', 'transformer'])
  assert args.given == set()
  args = pipeline.ParseArgs(['--models', 'transformer', '--K', '4', '--M',
                             '16', '--steps', '12'])
  assert args.given == {'K', 'M', 'steps'} and args.steps == 12


def test_devices_must_fit_the_cells():
  from bench import pipeline  # pylint: disable=g-import-not-at-top
  assert pipeline.ParseArgs(['--K', '2', '4', '--devices', '2']).devices == 2
  for bad in ('3', '0'):
    with pytest.raises(SystemExit) as e:
      pipeline.ParseArgs(['--K', '2', '4', '--devices', bad])
    assert e.value.code == 2


# --- bench/startup.py ----------------------------------------------------------


def testStartupRatiosAndMarkdown():
  from bench import startup  # pylint: disable=g-import-not-at-top
  records = startup.WithRatios([
      dict(engine='script', model='m', flags='', first_step_s=2.0,
           imports_s=1.0, params_s=0.1, build_s=0.5, first_run_s=0.4),
      dict(engine='lingvo_ext.trainer', model='m', flags='', first_step_s=3.0),
      dict(engine='lingvo.trainer', model='m', flags='', first_step_s=6.0),
      dict(engine='transformer/lingvo', model='L', flags='', first_step_s=4.0),
      dict(engine='transformer/unrolled', model='L', flags='',
           first_step_s=2.0),
      dict(engine='lingvo_ext.trainer', model='x', flags='', first_step_s=None,
           error='exit 1: boom')])
  assert records[1]['vs_script'] == 1.5 and records[1]['vs_lingvo'] == 0.5
  assert records[4]['vs_lingvo'] == 0.5
  assert 'vs_script' not in records[0] and 'vs_script' not in records[5]
  table = startup.Markdown(records).splitlines()
  assert len(table) == 2 + len(records)
  assert all(l.count('|') == table[0].count('|') for l in table), table
  assert 'exit 1: boom' in table[-1]


@pytest.mark.e2e
def testStartupBenchReportsTheTrainerAgainstTheScript():
  from bench import startup  # pylint: disable=g-import-not-at-top
  records = startup.Run([('lm.TransformerLmTiny', ())], [])
  assert [r['engine'] for r in records] == ['script', 'lingvo_ext.trainer',
                                            'lingvo.trainer']
  assert all('error' not in r for r in records), records
  script, trainer, lingvo = records
  # Structure only: each stage timed, the stages within the whole.
  stages = ('imports_s', 'params_s', 'build_s', 'first_run_s')
  assert all(isinstance(script[s], float) and script[s] >= 0 for s in stages)
  assert sum(script[s] for s in stages) <= script['process_s'] + 0.05
  assert trainer['first_step_s'] > 0
  assert trainer['vs_script'] == pytest.approx(
      trainer['first_step_s'] / script['first_step_s'], rel=1e-2)
  assert lingvo['first_step_s'] > 0
  assert trainer['vs_lingvo'] == pytest.approx(
      trainer['first_step_s'] / lingvo['first_step_s'], rel=1e-2)


def testStartupRoundsTakeMediansAndMedianRatiosInTurn(monkeypatch):
  from bench import startup  # pylint: disable=g-import-not-at-top
  calls = []
  script_s = iter([10., 20., 10.])
  trainer_s = iter([12., 21., 14.])

  def Fake(engine, times, **extra):
    def Measure(model, flags):
      calls.append(engine)
      return dict(engine=engine, model=model, flags=' '.join(flags),
                  first_step_s=next(times), **extra)
    return Measure

  monkeypatch.setattr(startup, 'ScriptRecord',
                      Fake('script', script_s, imports_s=1.))
  monkeypatch.setattr(startup, 'TrainerRecord',
                      Fake('lingvo_ext.trainer', trainer_s))
  emitted = []
  records = startup.Run([('m', ('--num_cpu_devices=2',))], [],
                        emit=emitted.append, rounds=3)
  # Each round starts one engine later; Lingvo's trainer is not run with flags.
  assert calls == ['script', 'lingvo_ext.trainer', 'lingvo_ext.trainer',
                   'script', 'script', 'lingvo_ext.trainer']
  assert len(emitted) == 6
  script, trainer = records
  assert script['first_step_s'] == 10. and script['rounds'] == 3
  assert trainer['first_step_s'] == 14.
  # The median of the rounds' ratios (1.2, 1.05, 1.4), not 14 / 10.
  assert trainer['vs_script'] == pytest.approx(1.2)


# --- bench/lingvo_lm.py --------------------------------------------------------


def testLingvoLmSummaryAndMarkdown():
  from bench import lingvo_lm  # pylint: disable=g-import-not-at-top
  records = [
      dict(engine='lingvo_ext', round=0, first_step_s=20., steps_per_s=4.,
           loss_1=5.5),
      dict(engine='lingvo', round=0, first_step_s=30., steps_per_s=2.,
           loss_1=5.5),
      dict(engine='lingvo', round=1, first_step_s=50., steps_per_s=1.,
           loss_1=5.5),
      dict(engine='lingvo_ext', round=1, first_step_s=22., steps_per_s=5.,
           loss_1=5.5)]
  summary = lingvo_lm.Summary(records)
  assert [r['engine'] for r in summary] == ['lingvo_ext', 'lingvo']
  ext, lingvo = summary
  assert (ext['first_step_s'], ext['steps_per_s']) == (21., 4.5)
  assert lingvo['first_step_vs_lingvo_ext'] == pytest.approx(40. / 21.)
  assert lingvo['lingvo_ext_speedup'] == pytest.approx(4.5 / 1.5)
  table = lingvo_lm.Markdown(summary + lingvo_lm.Summary(
      [dict(engine='lingvo', error='exit 1: AssertionError: [2, None]')])
  ).splitlines()
  assert len(table) == 5
  assert all(l.count('|') == table[0].count('|') for l in table), table
  assert 'AssertionError' in table[-1]


def testLingvoLmExperimentKeepsTheTimeAxisForBothEngines(tmp_path):
  from bench import lingvo_lm  # pylint: disable=g-import-not-at-top
  lingvo_lm.WriteExperiment(str(tmp_path))
  with open(tmp_path / 'lingvo_gpipe_lm.py') as f:
    source = f.read()
  assert str(tmp_path / 'train.txt') in source
  assert (tmp_path / 'train.txt').stat().st_size > 0
  # The benchmark-only subclass is in the written experiment only.
  assert 'def _TrimIfPossible(self, ids, paddings, labels, weights)' in source
  assert 'splits=2, num_micro_batches=4' in source
  import glob  # pylint: disable=g-import-not-at-top
  for path in glob.glob(os.path.join(_REPO, 'lingvo_ext', '**', '*.py'),
                        recursive=True):
    with open(path) as f:
      assert 'def _TrimIfPossible' not in f.read(), path
  for bad in (['--steps', '1'], ['--rounds', '0']):
    with pytest.raises(SystemExit):
      lingvo_lm.ParseArgs(bad)
