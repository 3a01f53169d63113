"""A pipeline's per-device timeline: planned, or measured in training.

Planned: a schedule's action lists (`lingvo_ext.pipeline.schedules`) simulated with
unit costs (forward 1, backward 2). Measured: a step traced with
`RunOptions.FULL_TRACE` (`step_trace`). Each draws a picture (PNG or SVG) and
a Chrome trace. The command line is `lingvo_ext.tools.timeline`; the
trainer's `--trace_train_step` calls `WriteTrainerTimeline`.
"""

import glob
import os
import socket
import struct
import time
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

from lingvo_ext.pipeline import kinds
from lingvo_ext.pipeline import records
from lingvo_ext.pipeline import simulate
from lingvo_ext.tracing import idle_split
from lingvo_ext.tracing import step_trace

# Colours per action kind, as in the schedule papers' figures.
KIND_COLORS = {
    'F': '#4c72b0',  # Forward.
    'R': '#8172b2',  # Recomputed forward.
    'B': '#dd8452',  # Backward (input and weight gradients).
    'I': '#dd8452',  # Input gradient.
    'W': '#55a868',  # Weight gradient.
}
_KIND_NAMES = {'F': 'forward', 'R': 'recompute', 'B': 'backward (I + W)',
               'I': 'input gradient', 'W': 'weight gradient'}

# (start, end, action) in time units of a forward pass.
Bar = Tuple[float, float, kinds.Action]


def PlannedBars(name: str, spec: kinds.StageSpec
               ) -> Tuple[List[List[Bar]], float]:
  """Per device, the simulated bars of a schedule, in the order they run.

  Args:
    name: A key of `records.ACTION_SCHEDULES`.
    spec: The pipeline.

  Returns:
    ([[(start, end, action)] per device], idle fraction).
  """
  schedule = records.Build(name, spec)
  tl = simulate.Simulate(spec, schedule)
  bars = [[(tl.start[a], tl.end[a], a) for a in acts] for acts in schedule]
  return bars, tl.IdleFraction()


def _Pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  return pyplot


def _Save(fig, path: str) -> None:
  # No date or software version in the file: the same plan, the same bytes.
  fig.savefig(path, dpi=100, metadata={'Software': None} if path.endswith(
      '.png') else {'Date': None, 'Creator': None})


def PlannedFigure(name: str, spec: kinds.StageSpec):
  """The planned timeline as a matplotlib figure; returns (figure, idle).

  One row per device (device d at y = d); each action a bar from its
  simulated start to its end, labelled with its micro-batch (and stage where
  a device holds several), coloured by kind.

  Args:
    name: A key of `records.ACTION_SCHEDULES`.
    spec: The pipeline.
  """
  from matplotlib import patches  # pylint: disable=g-import-not-at-top
  plt = _Pyplot()
  bars, idle = PlannedBars(name, spec)
  span = max((b[1] for dev in bars for b in dev), default=1.)
  several = spec.num_stages > spec.num_devices
  fig, ax = plt.subplots(figsize=(min(14, 2 + 0.28 * span),
                                  1.4 + 0.4 * spec.num_devices))
  for d, dev in enumerate(bars):
    for start, end, a in dev:
      ax.broken_barh([(start, end - start)], (d - 0.4, 0.8),
                     facecolors=KIND_COLORS[a.kind], edgecolor='white',
                     linewidth=0.8, label=str(a))
      text = ('%d.%d' % (a.stage, a.micro_batch) if several else
              str(a.micro_batch))
      ax.text((start + end) / 2, d, text, ha='center', va='center',
              fontsize=7, color='white')
  ax.set_yticks(range(spec.num_devices))
  ax.set_yticklabels(['device %d' % d for d in range(spec.num_devices)])
  ax.invert_yaxis()
  ax.set_xlim(0, span)
  ax.set_xlabel('time (forward pass = 1)')
  shown = sorted({b[2].kind for dev in bars for b in dev},
                 key=kinds.KINDS.index)
  ax.legend(handles=[patches.Patch(color=KIND_COLORS[k],
                                   label=_KIND_NAMES[k]) for k in shown],
            loc='upper left', bbox_to_anchor=(1.0, 1.0), fontsize=7,
            frameon=False)
  ax.set_title('%s: K=%d cells, M=%d micro-batches, %d devices; idle %.1f%%'
               % (name, spec.num_stages, spec.num_micro_batches,
                  spec.num_devices, 100 * idle), fontsize=9)
  fig.tight_layout()
  return fig, idle


def DrawPlanned(name: str, spec: kinds.StageSpec, path: str) -> float:
  """Writes `PlannedFigure` to `path` (.png or .svg); returns idle fraction."""
  plt = _Pyplot()
  plt.rcParams['svg.hashsalt'] = 'lingvo_ext'  # Stable ids: same plan, bytes.
  fig, idle = PlannedFigure(name, spec)
  _Save(fig, path)
  plt.close(fig)
  return idle


def PlannedChromeTrace(name: str, spec: kinds.StageSpec) -> Dict:
  """The planned timeline as a Chrome trace: a thread per device, 1 ms/unit."""
  bars, idle = PlannedBars(name, spec)
  events = [dict(ph='M', name='process_name', pid=0, tid=0,
                 args=dict(name='%s (planned, idle %.3f)' % (name, idle)))]
  for d, dev in enumerate(bars):
    events.append(dict(ph='M', name='thread_name', pid=0, tid=d,
                       args=dict(name='device %d' % d)))
    for start, end, a in dev:
      events.append(dict(ph='X', name=str(a), pid=0, tid=d, ts=start * 1e3,
                         dur=(end - start) * 1e3,
                         args=dict(kind=_KIND_NAMES[a.kind], stage=a.stage,
                                   micro_batch=a.micro_batch)))
  return dict(traceEvents=events, displayTimeUnit='ms')


def TracePath(logdir: str, step: Optional[int] = None) -> str:
  """The RunMetadata file `--trace_train_step` wrote under `logdir`."""
  if step:
    return os.path.join(logdir, 'train', f'run_metadata_step_{step}.pb')
  found = sorted(glob.glob(os.path.join(logdir, 'train',
                                        'run_metadata_step_*.pb')))
  if not found:
    raise ValueError(f'--logdir={logdir} has no traced step (no '
                     'train/run_metadata_step_N.pb); train with '
                     '--trace_train_step=N first.')
  return found[-1]


def _ImageEvent(png: bytes, tag: str, step: int) -> bytes:
  """A serialized TensorBoard `Event` holding one PNG image summary."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  width, height = struct.unpack('>II', png[16:24])  # The PNG's IHDR.
  image = tf.compat.v1.Summary.Image(height=height, width=width,
                                     colorspace=4, encoded_image_string=png)
  summary = tf.compat.v1.Summary(
      value=[tf.compat.v1.Summary.Value(tag=tag, image=image)])
  return tf.compat.v1.Event(wall_time=time.time(), step=step,
                            summary=summary).SerializeToString()


def WriteImageSummary(images: List[Tuple[str, str]], event_dir: str,
                      step: int) -> str:
  """Writes [(tag, PNG path)] as TensorBoard images in their own event file."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = os.path.join(event_dir, 'events.out.tfevents.%d.%s.timeline' %
                      (int(time.time()), socket.gethostname()))
  with tf.io.TFRecordWriter(path) as w:  # Event files are TFRecord files.
    w.write(tf.compat.v1.Event(wall_time=time.time(),
                               file_version='brain.Event:2'
                              ).SerializeToString())
    for tag, png_path in images:
      with open(png_path, 'rb') as f:
        w.write(_ImageEvent(f.read(), tag, step))
  return path


def DrawMeasured(run_metadata, out: str, trace_json: str,
                 title: str = '') -> float:
  """Writes a traced step's picture and Chrome trace; returns idle fraction.

  Args:
    run_metadata: A `tf.compat.v1.RunMetadata` of a FULL_TRACE step.
    out: The picture, .png or .svg.
    trace_json: The Chrome trace to write.
    title: The picture's title; the idle fraction is appended, split into
      bubble and overhead (idle_split.py).
  """
  intervals = step_trace.BusyIntervals(run_metadata.step_stats)
  split = idle_split.Split(intervals,
                           idle_split.WaitIntervals(run_metadata.step_stats))
  idle = step_trace.PlotGantt(intervals, out, title=title, split=split)
  step_trace.WriteJson(step_trace.StepStatsToChrome(run_metadata.step_stats),
                       trace_json)
  return idle


def PipelineSpecs(layer, path: str = ''
                 ) -> List[Tuple[str, str, kinds.StageSpec]]:
  """[(path, schedule, spec)] of each lingvo_ext pipeline in a built layer.

  The schedule whose lists the engine runs for the layer's `schedule`
  ('recurrent' as GPipe's), with the layer's cells, devices, micro-batches
  and `recompute` (None: on only where the schedule always recomputes).
  """
  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core import gpipe
  found = []
  if isinstance(layer, gpipe.PipeliningLayer):
    p = layer.params
    record = records.Get(p.schedule)
    name = record.planner.simulated_as or p.schedule
    recompute = (record.recompute == records.ALWAYS if p.recompute is None
                 else bool(p.recompute))
    spec = records.Placed(name, kinds.StageSpec(
        len(layer.Cells()), len(set(layer.Devices())), p.num_micro_batches,
        recompute))
    found.append((path or p.name, name, spec))
  for key, child in layer.children.FlattenItems():
    found += PipelineSpecs(child, f'{path}.{key}' if path else key)
  return found


def WriteTrainerTimeline(run_metadata, train_dir: str, step: int,
                         model=None) -> None:
  """What the trainer writes for `--trace_train_step=N` besides the .pb.

  `train_dir/timeline_step_N.png` (the measured per-device timeline) and
  `timeline_step_N.trace.json` (its Chrome trace); for each pipeline of
  `model`, `timeline_planned[_i].png` and `.trace.json` (its schedule
  simulated); the pictures as TensorBoard images `timeline` and
  `timeline_planned[_i]` at step N.
  """
  png = os.path.join(train_dir, f'timeline_step_{step}.png')
  DrawMeasured(run_metadata, png,
               os.path.join(train_dir, f'timeline_step_{step}.trace.json'),
               title=f'training step {step}')
  images = [('timeline', png)]
  pipelines = []
  for task in (model.tasks if model is not None else []):
    pipelines += PipelineSpecs(task)
  for i, (_, name, spec) in enumerate(pipelines):
    base = os.path.join(train_dir, 'timeline_planned' +
                        (f'_{i}' if len(pipelines) > 1 else ''))
    DrawPlanned(name, spec, base + '.png')
    step_trace.WriteJson(PlannedChromeTrace(name, spec), base + '.trace.json')
    images.append((os.path.basename(base), base + '.png'))
  WriteImageSummary(images, train_dir, step)
