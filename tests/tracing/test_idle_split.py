"""The measured timeline's idle time: bubble (waits on another device)
apart from overhead (nothing runs, nothing awaited), on a hand-made trace
whose waits are known."""

import pytest
from tensorflow.core.framework import step_stats_pb2

from lingvo_ext.tracing import idle_split
from lingvo_ext.tracing import step_trace


def _Node(dev, name, start, dur, op='MatMul'):
  n = dev.node_stats.add()
  n.node_name = name
  n.all_start_micros = start
  n.op_end_rel_micros = dur
  n.all_end_rel_micros = dur
  n.timeline_label = '%s = %s(x, y)' % (name, op)


def _Trace():
  """Two devices over [100, 200) us.

  CPU:0 runs [100, 130) and [170, 200); it waits for CPU:1's output while
  CPU:1 runs [130, 160), then on its receive, pending [150, 170): all 40 us
  of its idle time are bubble. CPU:1 waits while CPU:0 runs (60 us of
  bubble); over [160, 170) nothing runs on either device and CPU:1 awaits
  nothing: 10 us of overhead.
  """
  ss = step_stats_pb2.StepStats()
  d0 = ss.dev_stats.add()
  d0.device = '/job:localhost/replica:0/task:0/device:CPU:0'
  _Node(d0, 'cell_0_mb0/fc/MatMul', 100, 30)
  _Node(d0, 'cell_0/_Recv', 150, 20, op='_Recv')
  _Node(d0, 'gradients/cell_0_mb0/fc/MatMul_grad/MatMul', 170, 30)
  d1 = ss.dev_stats.add()
  d1.device = '/job:localhost/replica:0/task:0/device:CPU:1'
  _Node(d1, 'cell_1_mb0/fc/MatMul', 130, 30)
  return ss


def testTheKnownWaitsAreBubbleAndTheRestOverhead():
  ss = _Trace()
  intervals = step_trace.BusyIntervals(ss)
  waits = idle_split.WaitIntervals(ss)
  assert waits == {'CPU:0': [(150., 170.)]}
  bubbles = idle_split.Bubbles(intervals, waits)
  assert bubbles == {'CPU:0': [(130., 170.)],
                     'CPU:1': [(100., 130.), (170., 200.)]}
  split = idle_split.Split(intervals, waits)
  # Of 2 x 100 us: 110 idle, 100 of them bubble, 10 overhead.
  assert split.idle == pytest.approx(0.55)
  assert split.bubble == pytest.approx(0.5)
  assert split.overhead == pytest.approx(0.05)
  assert split.idle == pytest.approx(step_trace.IdleFraction(intervals))
  assert split.Describe() == 'idle 55.0%: bubble 50.0%, overhead 5.0%'


def testOneDeviceHasNoBubble():
  ss = step_stats_pb2.StepStats()
  d0 = ss.dev_stats.add()
  d0.device = '/job:localhost/replica:0/task:0/device:CPU:0'
  _Node(d0, 'a/MatMul', 0, 10)
  _Node(d0, 'b/MatMul', 30, 10)
  split = idle_split.Split(step_trace.BusyIntervals(ss),
                           idle_split.WaitIntervals(ss))
  assert (split.bubble, split.overhead) == (0., pytest.approx(0.5))


def testTheChartShowsBothInItsLegendAndTitle(tmp_path):
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  ss = _Trace()
  intervals = step_trace.BusyIntervals(ss)
  split = idle_split.Split(intervals, idle_split.WaitIntervals(ss))
  shown = {}
  real_savefig = pyplot.Figure.savefig

  def Keep(fig, path, **kwargs):
    ax = fig.axes[0]
    shown['title'] = ax.get_title()
    shown['legend'] = [t.get_text() for t in ax.get_legend().get_texts()]
    return real_savefig(fig, path, **kwargs)

  pyplot.Figure.savefig = Keep
  try:
    idle = step_trace.PlotGantt(intervals, str(tmp_path / 'g.png'),
                                title='step 5', split=split)
  finally:
    pyplot.Figure.savefig = real_savefig
  assert idle == pytest.approx(0.55)
  assert shown['title'] == 'step 5  idle 55.0%: bubble 50.0%, overhead 5.0%'
  assert shown['legend'][-2:] == ['bubble (waits on another device)',
                                  'overhead (nothing runs or waits)']
