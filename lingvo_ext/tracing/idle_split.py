"""A traced step's idle time split into bubble and overhead.

A device is idle where none of its ops runs (step_trace.BusyIntervals).
Of that time:

- **bubble**: the device waits on another device's output: another device
  of the step is running an op meanwhile (in a pipeline, the stage before
  or after it computing what it waits for), or a receive of a tensor from
  another device is pending on it (a `_Recv` node, where the step stats
  record one: TensorFlow leaves out those inside multi-device function
  calls, as lingvo_ext's cell functions are);
- **overhead**: no op runs on any device and nothing is awaited: the
  runtime's own work (the executor scheduling ops, the session's start and
  end, Python inside the traced window).

`Split` gives both as fractions of devices x the step's span (they add up
to step_trace.IdleFraction) with the per-device bubble intervals
(`Bubbles`) that the Gantt chart (step_trace.PlotGantt's `split`) hatches
apart from the overhead.
"""

import collections
import dataclasses
from typing import Dict
from typing import List
from typing import Sequence
from typing import Tuple

from lingvo_ext.tracing import step_trace

# Receives: what a device waits on another device's output through.
RECV_OPS = frozenset(['_Recv', 'Recv', '_HostRecv'])

Span = Tuple[float, float]


def WaitIntervals(step_stats) -> Dict[str, List[Span]]:
  """Per device, the (start_us, end_us) of each pending receive."""
  out = collections.defaultdict(list)
  names = step_trace.DeviceNames([dev.device for dev in step_stats.dev_stats])
  for dev in step_stats.dev_stats:
    name = names[dev.device]
    for n in dev.node_stats:
      if step_trace.OpType(n.timeline_label, n.node_name) in RECV_OPS:
        start = float(n.all_start_micros)
        out[name].append(
            (start, start + max(n.op_end_rel_micros, n.all_end_rel_micros)))
  return {d: sorted(v) for d, v in out.items()}


def _Minus(spans: Sequence[Span], cut: Sequence[Span]) -> List[Span]:
  """The parts of (merged) `spans` outside (merged) `cut`."""
  out = []
  cut = step_trace.Union(cut)
  for s, e in step_trace.Union(spans):
    for c0, c1 in cut:
      if c1 <= s or c0 >= e:
        continue
      if c0 > s:
        out.append((s, c0))
      s = max(s, c1)
      if s >= e:
        break
    if s < e:
      out.append((s, e))
  return out


def Bubbles(intervals: Dict[str, Sequence[step_trace.Interval]],
            waits: Dict[str, Sequence[Span]]) -> Dict[str, List[Span]]:
  """Per device, where it is idle waiting on another device (the bubble:
  another device busy, or a receive pending), within the step's span."""
  t0, t1 = step_trace.Span(intervals)
  out = {}
  for dev, ivs in intervals.items():
    others = [(s, e) for d, v in intervals.items() if d != dev
              for s, e, _ in v]
    clipped = [(max(s, t0), min(e, t1))
               for s, e in list(waits.get(dev, ())) + others
               if min(e, t1) > max(s, t0)]
    out[dev] = _Minus(clipped, [(s, e) for s, e, _ in ivs])
  return out


@dataclasses.dataclass(frozen=True)
class IdleSplit:
  """Fractions of devices x span: idle = bubble + overhead; and per device
  the bubble's (start_us, end_us) spans."""
  idle: float
  bubble: float
  overhead: float
  bubbles: Dict[str, List[Span]] = dataclasses.field(default_factory=dict)

  def Describe(self) -> str:
    return 'idle %.1f%%: bubble %.1f%%, overhead %.1f%%' % (
        100 * self.idle, 100 * self.bubble, 100 * self.overhead)


def Split(intervals: Dict[str, Sequence[step_trace.Interval]],
          waits: Dict[str, Sequence[Span]]) -> IdleSplit:
  """The step's idle fraction and its bubble and overhead parts."""
  idle = step_trace.IdleFraction(intervals)
  t0, t1 = step_trace.Span(intervals)
  if t1 <= t0 or not intervals:
    return IdleSplit(0., 0., 0.)
  bubbles = Bubbles(intervals, waits)
  waited = sum(e - s for spans in bubbles.values() for s, e in spans)
  bubble = min(waited / (len(intervals) * (t1 - t0)), idle)
  return IdleSplit(idle, bubble, max(idle - bubble, 0.), bubbles)
