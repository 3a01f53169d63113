"""lingvo-ext-timeline: the planned picture is the simulator's actions, the
measured one comes from a traced trainer run, the README's picture is
current."""

import json
import os
import subprocess
import sys

import pytest

from lingvo_ext.pipeline import schedules
from lingvo_ext.tools import timeline as timeline_tool
from lingvo_ext.tracing import timeline
from tests.support import ROOT
from tests.support import zygote

SPECS = [
    ('unrolled', schedules.StageSpec(4, 4, 8)),
    ('unrolled', schedules.StageSpec(3, 3, 5, recompute=True)),
    ('1f1b', schedules.StageSpec(4, 4, 8)),
    ('interleaved_1f1b', schedules.StageSpec(8, 4, 8)),
    ('zero_bubble', schedules.StageSpec(4, 4, 6)),
    ('zero_bubble', schedules.StageSpec(4, 2, 4)),
]


def _FigureBars(fig):
  """Per row (device), the drawn bars as (x, width, label) in drawn order."""
  ax = fig.axes[0]
  rows = {}
  for coll in ax.collections:
    (x0, y0), (x1, y1) = coll.get_paths()[0].get_extents().get_points()
    rows.setdefault(int(round((y0 + y1) / 2)), []).append(
        (x0, x1 - x0, coll.get_label()))
  return [rows.get(d, []) for d in range(len(rows))]


@pytest.mark.parametrize('name,spec', SPECS,
                         ids=['%s-%d' % (n, i) for i, (n, _) in
                              enumerate(SPECS)])
def testPlannedPictureIsTheSimulatedActions(name, spec):
  schedule = schedules.Build(name, spec)
  sim = schedules.Simulate(spec, schedule)
  fig, idle = timeline.PlannedFigure(name, spec)
  try:
    drawn = _FigureBars(fig)
  finally:
    fig.clf()
  assert idle == pytest.approx(sim.IdleFraction())
  assert len(drawn) == spec.num_devices
  for d, acts in enumerate(schedule):
    # One bar per action of the device, in the device's order, each where
    # the simulator runs it.
    assert [label for _, _, label in drawn[d]] == [str(a) for a in acts]
    for (x, width, _), a in zip(drawn[d], acts):
      assert x == pytest.approx(sim.start[a])
      assert x + width == pytest.approx(sim.end[a])
    starts = [x for x, _, _ in drawn[d]]
    assert starts == sorted(starts)


def testPlannedChromeTraceHasEveryAction(tmp_path):
  spec = schedules.StageSpec(4, 4, 8)
  trace = timeline.PlannedChromeTrace('zero_bubble', spec)
  schedule = schedules.Build('zero_bubble', spec)
  for d, acts in enumerate(schedule):
    names = [e['name'] for e in trace['traceEvents']
             if e['ph'] == 'X' and e['tid'] == d]
    assert names == [str(a) for a in acts]


def testCommandLine(tmp_path):
  out = str(tmp_path / 'p.svg')
  assert timeline_tool.main(['--schedule=1f1b', '--num_stages=2',
                        '--num_micro_batches=3', '--out=' + out]) == 0
  assert os.path.getsize(out) > 0
  with open(str(tmp_path / 'p.trace.json')) as f:
    events = json.load(f)['traceEvents']
  assert sum(e['ph'] == 'X' for e in events) == len(
      [a for acts in schedules.Build('1f1b', schedules.StageSpec(2, 2, 3))
       for a in acts])


@pytest.mark.parametrize('args', [
    ['--schedule=recurrent'],
    ['--schedule=1f1b', '--logdir=/tmp'],
    ['--schedule=1f1b', '--devices=8', '--num_stages=4'],
    ['--schedule=1f1b', '--num_micro_batches=0'],
])
def testBadInputIsOneLineAndExit2(args, tmp_path, capsys):
  assert timeline_tool.main(args + ['--out=%s/x.png' % tmp_path]) == 2
  err = capsys.readouterr().err.strip().split('\n')
  assert len(err) == 1 and err[0].startswith('error: '), err
  assert not os.path.exists(str(tmp_path / 'x.png'))


def testReadmePictureIsCurrent(tmp_path):
  # README.md shows docs/img/pipeline-1f1b.png: the plan as drawn today.
  out = str(tmp_path / 'pipeline-1f1b.png')
  timeline.DrawPlanned('1f1b', schedules.StageSpec(4, 4, 8), out)
  with open(out, 'rb') as f, open(
      os.path.join(ROOT, 'docs', 'img', 'pipeline-1f1b.png'), 'rb') as g:
    assert f.read() == g.read(), (
        'regenerate it: .venv/bin/lingvo-ext-timeline --schedule=1f1b '
        '--num_stages=4 --num_micro_batches=8 --out=docs/img/pipeline-1f1b.png')


@pytest.mark.e2e
def testTracedTrainerRunGivesTheMeasuredPicture(tmp_path):
  logdir = str(tmp_path / 'logdir')
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer',
       '--model=lm.TransformerLmTinyGPipe', f'--logdir={logdir}',
       '--max_steps=3', '--num_cpu_devices=2', '--worker_split_size=2',
       '--trace_train_step=2'], cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-5000:]
  train = os.path.join(logdir, 'train')
  assert os.path.getsize(os.path.join(train, 'timeline_step_2.png')) > 0
  with open(os.path.join(train, 'timeline_step_2.trace.json')) as f:
    events = json.load(f)['traceEvents']
  threads = {e['args']['name'] for e in events if e['name'] == 'thread_name'}
  assert {'CPU:0', 'CPU:1'} <= threads  # The two cells' devices.
  busy = {e['tid'] for e in events if e['ph'] == 'X'}
  assert len(busy) >= 2
  # The TensorBoard image.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tags = []
  for name in os.listdir(train):
    if name.endswith('.timeline'):
      for record in tf.compat.v1.io.tf_record_iterator(
          os.path.join(train, name)):
        event = tf.compat.v1.Event.FromString(record)
        tags += [(v.tag, event.step, v.image.encoded_image_string[:4])
                 for v in event.summary.value]
  assert tags == [('timeline', 2, b'\x89PNG'),
                  ('timeline_planned', 2, b'\x89PNG')]
  # The planned picture: the model's pipeline, its schedule simulated.
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  task = experiment_params.GetParams('lm.TransformerLmTinyGPipe', 'Train').task
  assert os.path.getsize(os.path.join(train, 'timeline_planned.png')) > 0
  with open(os.path.join(train, 'timeline_planned.trace.json')) as f:
    planned = json.load(f)
  assert planned == json.loads(json.dumps(timeline.PlannedChromeTrace(
      task.schedule, schedules.StageSpec(task.num_partitions, 2,
                                       task.num_micro_batches))))
  # The command line, from the logdir.
  out = str(tmp_path / 'step.svg')
  assert timeline_tool.main(['--logdir=' + logdir, '--out=' + out]) == 0
  assert os.path.getsize(out) > 0


def testDevicesOfSeveralTasksKeepTheirTask():
  from tensorflow.core.framework import step_stats_pb2  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top

  from lingvo_ext.tracing import step_trace  # pylint: disable=g-import-not-at-top
  stats = step_stats_pb2.StepStats()
  for task in (0, 1):
    dev = stats.dev_stats.add()
    dev.device = '/job:worker/replica:0/task:%d/device:CPU:0' % task
    node = dev.node_stats.add()
    node.node_name = 'cell%d/MatMul' % task
    node.timeline_label = 'cell%d/MatMul = MatMul(a, b)' % task
    node.all_start_micros = 100 + 10 * task
    node.op_end_rel_micros = 5
  intervals = step_trace.BusyIntervals(stats)
  assert sorted(intervals) == ['worker:0/CPU:0', 'worker:1/CPU:0']
  chrome = step_trace.StepStatsToChrome(stats)
  threads = [e['args']['name'] for e in chrome['traceEvents']
             if e['name'] == 'thread_name']
  assert threads == ['worker:0/CPU:0', 'worker:1/CPU:0']
  starts = [e['ts'] for e in chrome['traceEvents'] if e['ph'] == 'X']
  assert starts == [0.0, 10.0]
