"""Busy intervals, idle fraction and a Gantt chart of one traced step.

The measured side of `lingvo-ext-timeline` (`lingvo_ext.tools.timeline`) and
of the benches' `--trace`.

Two sources:

- TensorFlow's `RunMetadata.step_stats` (`RunOptions.FULL_TRACE`): one entry
  per executed graph node, per device. Ops inside the bodies of functional
  `While` loops (Lingvo's `recurrent` loops) are NOT recorded there: the loop
  shows up as a single `While` node whose duration also covers the waits for
  the neighbouring device inside the loop. Ops inside `PartitionedCall`
  functions are recorded, so the call node itself is skipped as a container.
- The TF profiler's host trace (`ProfilerSession`, optional): one event per
  op kernel run on an executor thread, loop bodies included, but with no
  device. It says what the 2 inter-op threads actually did.

Labelling heuristic (`Classify`), on node names and op types:

- 'update': variable updates (`AssignSub*`, `Apply*`, `ResourceApply*`).
- 'bwd': names under `gradients/` or containing `_grad/`, op types ending
  in `Grad`, and Lingvo's backward loop (`gradients/..._grad/While`).
- 'fwd': everything else (including Lingvo's forward loop `While`).
- Micro-batch: a `_mb<t>` name scope (lingvo_ext's unrolled schedule names
  scopes `<cell>_mb<t>`); Lingvo's loops carry no index, so it is None.
"""

import collections
import json
import re
from typing import Dict
from typing import Iterable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

# (start_us, end_us, label); label is 'fwd', 'bwd', 'update', 'other', with
# ':mb<t>' appended when the micro-batch is known.
Interval = Tuple[float, float, str]

# Function calls: their traced time spans their body ops, recorded too.
CALL_OPS = frozenset(['PartitionedCall', 'StatefulPartitionedCall'])
# Nodes that are not work on the device: containers whose body ops are
# recorded separately, and receives whose duration is mostly waiting.
_NOT_BUSY_OPS = CALL_OPS | frozenset([
    '_Recv', '_HostRecv', 'Recv', '_SOURCE', 'NoOp', '_Arg', '_Retval',
    '_DeviceArg', '_DeviceRetval'
])
_UPDATE_OP = re.compile(r'^(Resource)?(Apply|AssignSub|AssignAdd|Assign)')
_MICRO_BATCH = re.compile(r'_mb(\d+)(?:/|$|_)')
_OP_TYPE = re.compile(r'=\s*([A-Za-z0-9_]+)\(')


def ShortDevice(device: str) -> str:
  """'/job:localhost/replica:0/task:0/device:CPU:0' -> 'CPU:0'."""
  m = re.search(r'device:([^/]+)$', device)
  return m.group(1) if m else device


def DeviceNames(devices: Sequence[str]) -> Dict[str, str]:
  """Short names, with the job and task where tasks share them."""
  short = {d: ShortDevice(d) for d in devices}
  if len(set(short.values())) == len(set(devices)):
    return short
  out = {}
  for d in devices:
    m = re.search(r'/job:([^/]+)/replica:\d+/task:(\d+)', d)
    out[d] = '%s:%s/%s' % (m.group(1), m.group(2), short[d]) if m else d
  return out


def OpType(timeline_label: str, node_name: str = '') -> str:
  """The op type from a step-stats timeline label 'name = Op(inputs)'."""
  m = _OP_TYPE.search(timeline_label or '')
  if m:
    return m.group(1)
  return node_name if node_name.startswith('_') else ''


def Classify(node_name: str, op_type: str = '') -> str:
  """'fwd', 'bwd' or 'update', with ':mb<t>' when the micro-batch is known.

  Args:
    node_name: The node's (or op event's) full name.
    op_type: Its op type, when known.

  Returns:
    The label; see the module docstring for the heuristic.
  """
  base = node_name.split(':')[0]
  if _UPDATE_OP.match(op_type) or _UPDATE_OP.match(base.split('/')[-1]):
    phase = 'update'
  elif (base.startswith('gradients') or '/gradients' in base or
        '_grad/' in base or op_type.endswith('Grad') or
        op_type == 'SymbolicGradient'):
    phase = 'bwd'
  else:
    phase = 'fwd'
  m = _MICRO_BATCH.search(base)
  return '%s:mb%s' % (phase, m.group(1)) if m else phase


def Phase(label: str) -> str:
  return label.split(':')[0]


def MicroBatch(label: str) -> Optional[int]:
  parts = label.split(':mb')
  return int(parts[1]) if len(parts) == 2 else None


def BusyIntervals(step_stats) -> Dict[str, List[Interval]]:
  """Per device, the intervals during which a recorded op ran.

  Args:
    step_stats: A `step_stats_pb2.StepStats`.

  Returns:
    {short device name: [(start_us, end_us, label)]} sorted by start. The end
    is `all_start + max(op_end_rel, all_end_rel)`; containers and receives
    (`_NOT_BUSY_OPS`) are left out. Devices with no busy node are kept, empty.
  """
  out = collections.defaultdict(list)
  names = DeviceNames([dev.device for dev in step_stats.dev_stats])
  for dev in step_stats.dev_stats:
    name = names[dev.device]
    out[name]  # pylint: disable=pointless-statement
    for n in dev.node_stats:
      op = OpType(n.timeline_label, n.node_name)
      if op in _NOT_BUSY_OPS or n.node_name == '_SOURCE':
        continue
      start = float(n.all_start_micros)
      end = start + max(n.op_end_rel_micros, n.all_end_rel_micros)
      out[name].append((start, end, Classify(n.node_name, op)))
  return {d: sorted(v) for d, v in sorted(out.items())}


def Union(
    intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
  """Merges overlapping [start, end) intervals."""
  merged = []
  for s, e in sorted((i[0], i[1]) for i in intervals):
    if merged and s <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], e))
    else:
      merged.append((s, e))
  return merged


def Span(intervals: Dict[str, Sequence[Interval]]) -> Tuple[float, float]:
  """(first start, last end) over all devices."""
  all_iv = [iv for v in intervals.values() for iv in v]
  if not all_iv:
    return 0.0, 0.0
  return min(i[0] for i in all_iv), max(i[1] for i in all_iv)


def IdleFraction(intervals: Dict[str, Sequence[Interval]],
                 t0: Optional[float] = None,
                 t1: Optional[float] = None) -> float:
  """1 - (sum over devices of the union of busy time) / (devices * span).

  Args:
    intervals: {device: [(start, end, label)]}, e.g. from `BusyIntervals`.
    t0: Start of the window; defaults to the first start.
    t1: End of the window; defaults to the last end.

  Returns:
    The idle fraction in [0, 1]; 0 for an empty window. Busy time is clipped
    to [t0, t1].
  """
  lo, hi = Span(intervals)
  t0 = lo if t0 is None else t0
  t1 = hi if t1 is None else t1
  if t1 <= t0 or not intervals:
    return 0.0
  busy = 0.0
  for ivs in intervals.values():
    for s, e in Union(ivs):
      busy += max(0.0, min(e, t1) - max(s, t0))
  return 1.0 - busy / (len(intervals) * (t1 - t0))


# --- Host trace (TF profiler) -------------------------------------------------

# (thread name, start_us, end_us, op name, op type)
HostEvent = Tuple[str, float, float, str, str]


def HostOpEvents(trace) -> List[HostEvent]:
  """Op-kernel events on TF's compute threads from a profiler `Trace` proto.

  Args:
    trace: A `tensorflow.tsl.profiler.protobuf.trace_events_pb2.Trace`, as
      returned (serialized) by `ProfilerSession.stop()`.

  Returns:
    Events that carry a `long_name` ('node/name:OpType'), on threads whose
    name starts with 'tf_' (the inter-op pool), sorted by start.
  """
  threads = {}
  for dev in trace.devices.values():
    for rid, res in dev.resources.items():
      threads[rid] = res.name
  out = []
  for e in trace.trace_events:
    long_name = e.args.get('long_name')
    thread = threads.get(e.resource_id, str(e.resource_id))
    if not long_name or not thread.startswith('tf_'):
      continue
    name, _, op = long_name.rpartition(':')
    start = e.timestamp_ps / 1e6
    out.append((thread, start, start + e.duration_ps / 1e6, name, op))
  return sorted(out, key=lambda x: x[1])


def HostTraceToChrome(trace) -> Dict:
  """A Chrome/Perfetto trace ('X' events, microseconds) of a profiler Trace."""
  events = []
  for did, dev in trace.devices.items():
    events.append(dict(ph='M', name='process_name', pid=did, tid=0,
                       args=dict(name=dev.name)))
    for rid, res in dev.resources.items():
      events.append(dict(ph='M', name='thread_name', pid=did, tid=rid,
                         args=dict(name=res.name)))
  for e in trace.trace_events:
    if e.name.startswith('ThreadpoolListener'):
      continue
    events.append(dict(ph='X', name=e.name, pid=e.device_id,
                       tid=e.resource_id, ts=e.timestamp_ps / 1e6,
                       dur=e.duration_ps / 1e6, args=dict(e.args)))
  return dict(traceEvents=events, displayTimeUnit='ms')


def StepStatsToChrome(step_stats) -> Dict:
  """A Chrome/Perfetto trace of a step's step stats: a track per device.

  Args:
    step_stats: A `step_stats_pb2.StepStats`.

  Returns:
    The trace as a dict ('X' events in microseconds since the first op, one
    thread per device, named by `BusyIntervals`' device names), for
    `WriteJson`; open it in https://ui.perfetto.dev or chrome://tracing.
  """
  names = DeviceNames([dev.device for dev in step_stats.dev_stats])
  t0 = min((n.all_start_micros for dev in step_stats.dev_stats
            for n in dev.node_stats), default=0)
  events = [dict(ph='M', name='process_name', pid=0, tid=0,
                 args=dict(name='training step'))]
  for tid, dev in enumerate(step_stats.dev_stats):
    events.append(dict(ph='M', name='thread_name', pid=0, tid=tid,
                       args=dict(name=names[dev.device])))
    for n in dev.node_stats:
      op = OpType(n.timeline_label, n.node_name)
      if n.node_name == '_SOURCE':
        continue
      events.append(dict(
          ph='X', name=op or n.node_name, pid=0, tid=tid,
          ts=float(n.all_start_micros - t0),
          dur=float(max(n.op_end_rel_micros, n.all_end_rel_micros)),
          args=dict(name=n.node_name, label=Classify(n.node_name, op))))
  return dict(traceEvents=events, displayTimeUnit='ms')


# What an op is for, to say where a step's time goes. Checked in order.
_CATEGORIES = (
    ('loop control', re.compile(
        r'^(While|If|Less|Greater|GreaterEqual|LogicalAnd|Enter|Exit|Merge|'
        r'Switch|NextIteration|LoopCond)')),
    ('accumulate/state', re.compile(
        r'^(InplaceUpdate|InplaceAdd|TensorListSetItem|TensorListGetItem|'
        r'TensorListPushBack|TensorListPopBack|GatherV2|Gather|Pack|Unpack|'
        r'Empty|ZerosLike|Fill|StridedSlice|Slice|ConcatV2|Concat|Split|'
        r'SplitV|Reshape|Identity|IdentityN|Stack|StackV2|Tile)$')),
    ('copy/send', re.compile(r'^(_Send|_Recv|Send|Recv|_HostSend|_HostRecv)$')),
    ('checks', re.compile(r'^(CheckNumerics|Assert.*)$')),
    ('update', re.compile(r'^(Resource)?(Apply|AssignSub|AssignAdd|Assign)')),
)


def Category(op_type: str) -> str:
  for name, pattern in _CATEGORIES:
    if pattern.match(op_type):
      return name
  return 'compute'


def HostBreakdown(events: Sequence[HostEvent]) -> Dict:
  """Where the compute threads' time went during one step.

  Args:
    events: From `HostOpEvents`.

  Returns:
    A dict: span_us (first start to last end), per-thread busy_us (union of
    op time), thread_idle_fraction, op time per category (us), the
    fwd/bwd/update split, and time and count for the top op types and the
    top op names with digits replaced by '#'.
  """
  if not events:
    return {}
  t0 = min(e[1] for e in events)
  t1 = max(e[2] for e in events)
  by_thread = collections.defaultdict(list)
  cat = collections.Counter()
  op_us = collections.Counter()
  op_n = collections.Counter()
  phase = collections.Counter()
  name_us = collections.Counter()
  name_n = collections.Counter()
  for thread, s, e, name, op in events:
    by_thread[thread].append((s, e))
    cat[Category(op)] += e - s
    op_us[op] += e - s
    op_n[op] += 1
    phase[Phase(Classify(name, op))] += e - s
    # Digits out, so all micro-batches, layers and cells of an op add up.
    generic = re.sub(r'\d+', '#', name)
    name_us[generic] += e - s
    name_n[generic] += 1
  busy = {t: sum(e - s for s, e in Union(v)) for t, v in by_thread.items()}
  return dict(
      span_us=t1 - t0,
      num_threads=len(busy),
      busy_us=busy,
      thread_idle_fraction=1.0 - sum(busy.values()) /
      (len(busy) * (t1 - t0)) if t1 > t0 else 0.0,
      category_us=dict(cat.most_common()),
      phase_us=dict(phase.most_common()),
      top_ops=[dict(op=op, us=round(us, 1), count=op_n[op])
               for op, us in op_us.most_common(15)],
      top_names=[dict(name=n, us=round(us, 1), count=name_n[n])
                 for n, us in name_us.most_common(15)])


# --- Gantt chart --------------------------------------------------------------

_COLORS = {'fwd': 'Blues', 'bwd': 'Oranges', 'update': 'Greens'}


def _Color(label: str, num_micro_batches: int):
  import matplotlib  # pylint: disable=g-import-not-at-top
  phase = Phase(label)
  if phase not in _COLORS:
    return '0.5'
  mb = MicroBatch(label)
  cmap = matplotlib.colormaps[_COLORS[phase]]
  if mb is None or num_micro_batches <= 1:
    return cmap(0.65)
  return cmap(0.35 + 0.55 * (mb % num_micro_batches) /
              (num_micro_batches - 1))


def PlotGantt(intervals: Dict[str, Sequence[Interval]],
              path: str,
              title: str = '',
              host_events: Optional[Sequence[HostEvent]] = None,
              split=None) -> float:
  """Writes a PNG Gantt chart of one step; returns its idle fraction.

  One row per device with the busy intervals (forward blue, backward orange,
  update green; darker = later micro-batch where known) over a hatched red
  background where the device is idle (the bubble). With `host_events`, a
  second panel has one row per compute thread with every op the profiler saw.

  Args:
    intervals: {device: [(start_us, end_us, label)]}, from `BusyIntervals`.
    path: The PNG file to write.
    title: Prefix of the title; the idle fraction is appended.
    host_events: Optional, from `HostOpEvents`.
    split: Optional, idle_split.Split's: then the idle time is drawn as
      bubble (red: waits on another device) and overhead (grey), both in
      the legend and the title.

  Returns:
    `IdleFraction(intervals)`.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import patches  # pylint: disable=g-import-not-at-top
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  idle = IdleFraction(intervals)
  t0, t1 = Span(intervals)
  bubbles = None if split is None else split.bubbles
  mbs = [MicroBatch(l) for v in intervals.values() for (_, _, l) in v]
  num_mb = max([m for m in mbs if m is not None] or [0]) + 1
  panels = 2 if host_events else 1
  fig, axes = plt.subplots(
      panels, 1, squeeze=False,
      figsize=(12, 1.2 + 0.7 * len(intervals) +
               (1.5 if host_events else 0)))
  ax = axes[0][0]
  devices = list(intervals)
  for row, dev in enumerate(devices):
    ax.broken_barh([(0, (t1 - t0) / 1e3)], (row - 0.4, 0.8),
                   facecolor='mistyrose' if bubbles is None else '0.92',
                   edgecolor='none', hatch='//' if bubbles is None else '..')
    if bubbles is not None:
      ax.broken_barh([((s - t0) / 1e3, (e - s) / 1e3)
                      for s, e in bubbles.get(dev, ())], (row - 0.4, 0.8),
                     facecolor='mistyrose', edgecolor='none', hatch='//')
    ivs = intervals[dev]
    ax.broken_barh([((s - t0) / 1e3, (e - s) / 1e3) for s, e, _ in ivs],
                   (row - 0.4, 0.8),
                   facecolors=[_Color(l, num_mb) for _, _, l in ivs],
                   edgecolor='none')
  ax.set_yticks(range(len(devices)))
  ax.set_yticklabels(devices)
  ax.invert_yaxis()
  ax.set_xlim(0, max(t1 - t0, 1) / 1e3)
  ax.set_xlabel('ms since the first op (step stats; one row per device)')
  handles = [patches.Patch(color=_Color(p, 1), label=p)
             for p in ('fwd', 'bwd', 'update')]
  handles.append(patches.Patch(facecolor='mistyrose', hatch='//', label=(
      'idle (bubble)' if bubbles is None else
      'bubble (waits on another device)')))
  if bubbles is not None:
    handles.append(patches.Patch(facecolor='0.92', hatch='..',
                                 label='overhead (nothing runs or waits)'))
  # Below the axes: inside them, the legend hides the last device's bars.
  ax.legend(handles=handles, loc='upper center', bbox_to_anchor=(0.5, -0.22),
            fontsize=7, ncol=4, frameon=False)
  ax.set_title('%s  %s' % (title, 'idle fraction %.1f%%' % (100 * idle)
                            if split is None else split.Describe()))
  if host_events:
    hx = axes[1][0]
    threads = sorted({e[0] for e in host_events})
    h0 = min(e[1] for e in host_events)
    h1 = max(e[2] for e in host_events)
    for row, th in enumerate(threads):
      evs = [e for e in host_events if e[0] == th]
      hx.broken_barh([(0, (h1 - h0) / 1e3)], (row - 0.4, 0.8),
                     facecolor='mistyrose', edgecolor='none', hatch='//')
      hx.broken_barh(
          [((s - h0) / 1e3, (e - s) / 1e3) for _, s, e, _, _ in evs],
          (row - 0.4, 0.8),
          facecolors=[
              _Color(Classify(n, op), 1)
              if Category(op) in ('compute', 'update') else '0.3'
              for _, _, _, n, op in evs
          ],
          edgecolor='none')
    hx.set_yticks(range(len(threads)))
    hx.set_yticklabels(['thread %d' % i for i in range(len(threads))])
    hx.invert_yaxis()
    hx.set_xlim(0, max(h1 - h0, 1) / 1e3)
    hx.set_xlabel('ms (profiler host trace, a later step; thread rows; '
                  'grey = loop control, copies, accumulators)')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return idle


def WriteJson(obj, path: str) -> None:
  with open(path, 'w') as f:
    json.dump(obj, f)
