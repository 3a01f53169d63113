"""bench/pipeline.py's output: its markdown tables and a step's traced
timelines (planned against measured)."""

import os
from typing import Dict
from typing import Sequence

import lingvo.compat as tf

from bench import pipeline_step
from bench import torch_common  # pylint: disable=g-import-not-at-top
from bench import transformer_report  # pylint: disable=g-import-not-at-top
from lingvo_ext.tracing import step_trace


def Fmt(x, fmt='%.1f') -> str:
  """A table cell: '-' for a missing value."""
  return '-' if x is None else fmt % x


def MarkdownVsTorch(records: Sequence[Dict]) -> str:
  """One row per (model, K, M) with lingvo_ext: it against TF and torch."""
  torch_by = {}
  tf_by = {}
  for r in records:
    if r.get('framework') == 'torch':
      torch_by.setdefault(r['model'], {})[(r['impl'], r['K'], r['M'])] = r
    else:
      tf_by.setdefault((r['model'], r['K'], r['M']), {})[r['impl']] = r

  def _Ms(r):
    return None if r is None else r['step_ms']

  def _Ratio(a, b):
    return None if a is None or b is None else a / b

  lines = [
      '| model | K | M | lingvo_ext ms | TF plain ms | torch plain ms '
      '| torch GPipe ms | torch 1F1B ms | ext / TF plain | ext / torch plain '
      '| ext / torch GPipe | ext / torch 1F1B |',
      '|' + '---|' * 12,
  ]
  for (model, k, m), c in tf_by.items():
    t = torch_by.get(model)
    if not t or 'lingvo_ext' not in c:
      continue
    ext = _Ms(c['lingvo_ext'])
    tf_plain = _Ms(c.get('plain'))
    t_plain = _Ms(t.get(('torch/plain', 1, 1)))
    gpipe = _Ms(t.get(('torch/gpipe', k, m)))
    f1b = _Ms(t.get(('torch/1f1b', k, m)))
    lines.append('| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s '
                 '|' % (model, k, m, Fmt(ext), Fmt(tf_plain), Fmt(t_plain),
                        Fmt(gpipe), Fmt(f1b),
                        Fmt(_Ratio(ext, tf_plain), '%.2f'),
                        Fmt(_Ratio(ext, t_plain), '%.2f'),
                        Fmt(_Ratio(ext, gpipe), '%.2f'),
                        Fmt(_Ratio(ext, f1b), '%.2f')))
  return '\n'.join(lines)


def HostTrace(sess, fetch):
  """One step under TF's profiler: a trace_events_pb2.Trace, or None."""
  try:
    # pylint: disable=g-import-not-at-top
    from tensorflow.python.profiler.internal import _pywrap_profiler
    from tensorflow.tsl.profiler.protobuf import trace_events_pb2
    # pylint: enable=g-import-not-at-top
    trace = None
    for _ in range(2):  # The first profiled step pays set-up costs.
      session = _pywrap_profiler.ProfilerSession()
      session.start('', {'host_tracer_level': 2, 'python_tracer_level': 0,
                         'device_tracer_level': 0})
      try:
        sess.run(fetch)
      finally:
        data = session.stop()
      trace = trace_events_pb2.Trace()
      trace.ParseFromString(data)
    return trace
  except Exception as e:  # pylint: disable=broad-except
    pipeline_step.Log('host trace unavailable: %r' % e)
    return None


def TraceStep(step: pipeline_step.Step, directory: str, name: str, title: str) -> Dict:
  """Writes one step's Chrome trace, host trace and Gantt PNG; returns stats.

  Files: <name>.trace.json (step stats via TF's timeline module),
  <name>.host_trace.json (profiler, ops inside loops too), <name>.png.
  """
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.client import timeline as tf_timeline
  # pylint: enable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
  metadata = None
  for _ in range(2):  # The first traced step re-instantiates functions.
    metadata = tf.RunMetadata()
    step.sess.run(step.train, options=options, run_metadata=metadata)
  prefix = os.path.join(directory, name)
  with open(prefix + '.trace.json', 'w') as f:
    f.write(tf_timeline.Timeline(
        metadata.step_stats).generate_chrome_trace_format())
  intervals = step_trace.BusyIntervals(metadata.step_stats)
  t0, t1 = step_trace.Span(intervals)
  host = HostTrace(step.sess, step.train)
  host_events = step_trace.HostOpEvents(host) if host is not None else None
  if host is not None:
    step_trace.WriteJson(step_trace.HostTraceToChrome(host),
                         prefix + '.host_trace.json')
  idle = step_trace.PlotGantt(intervals, prefix + '.png', title=title,
                              host_events=host_events)
  stats = dict(
      name=name, idle_fraction=round(idle, 4), traced_span_ms=round(
          (t1 - t0) / 1e3, 3),
      busy_ms={d: round(sum(e - s for s, e in step_trace.Union(v)) / 1e3, 3)
               for d, v in intervals.items()},
      opaque_loops=[
          dict(device=d, node=n.node_name, ms=round(
              n.all_end_rel_micros / 1e3, 3))
          for dev in metadata.step_stats.dev_stats
          for d in [step_trace.ShortDevice(dev.device)]
          for n in dev.node_stats
          if step_trace.OpType(n.timeline_label) == 'While'
      ])
  if host_events:
    stats['host'] = step_trace.HostBreakdown(host_events)
  return stats


def MarkdownDtypes(records: Sequence[Dict]) -> str:
  """One row per (model, K, M, impl): bfloat16 beside float32."""
  by = {}
  for r in records:
    by.setdefault((r['model'], r['K'], r['M'], r['impl']),
                  {})[r['dtype']] = r
  lines = [
      '| model | K | M | impl | float32 ms | bf16 ms | bf16 / float32 '
      '| bytes between cells per step float32 / bf16 | first-loss rel. diff '
      '| oneDNN |',
      '|' + '---|' * 10,
  ]
  for (model, k, m, impl), d in by.items():
    f, b = d.get('float32'), d.get('bfloat16')
    if not f or not b:
      continue
    lines.append('| %s | %d | %d | %s | %s | %s | %s | %d / %d | %s | %s |' % (
        model, k, m, impl, Fmt(f['step_ms']), Fmt(b['step_ms']),
        Fmt(b.get('vs_float32'), '%.2fx'), f['bytes_between_cells'],
        b['bytes_between_cells'], Fmt(b.get('first_loss_rel_diff'), '%.2g'),
        transformer_report.OneDnnCell(b)))
  return '\n'.join(lines)


def Markdown(records: Sequence[Dict]) -> str:
  """One table row per (model, K, M)."""
  by_cfg = {}
  for r in records:
    by_cfg.setdefault((r['model'], r['K'], r['M']), {})[r['impl']] = r

  lines = [
      '| model | K | M | lingvo ms | lingvo_ext ms | plain ms | ext/lingvo '
      '| lingvo/plain | ext/plain | ideal ms | lingvo/ideal | ext/ideal '
      '| slowest/mean cell | peak RSS MB lingvo / ext / plain |',
      '|' + '---|' * 14,
  ]
  for (model, k, m), c in by_cfg.items():
    if not all(i in c for i in pipeline_step.IMPLS):
      continue
    l, e, p = c['lingvo'], c['lingvo_ext'], c['plain']
    lines.append('| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s '
                 '| %s | %s / %s / %s |' % (
                     model, k, m, Fmt(l['step_ms']), Fmt(e['step_ms']),
                     Fmt(p['step_ms']), Fmt(e['vs_lingvo'], '%.2f'),
                     Fmt(l['vs_plain'], '%.2f'), Fmt(e['vs_plain'], '%.2f'),
                     Fmt(l['ideal_ms']), Fmt(l['vs_ideal'], '%.2f'),
                     Fmt(e['vs_ideal'], '%.2f'),
                     Fmt(l['cell_cost_max_over_mean'], '%.2f'),
                     Fmt(l['peak_rss_mb'], '%.0f'),
                     Fmt(e['peak_rss_mb'], '%.0f'),
                     Fmt(p['peak_rss_mb'], '%.0f')))
  return '\n'.join(lines)


def MarkdownSchedules(records: Sequence[Dict]) -> str:
  """One row per (model, K, M, lingvo_ext impl): time and peak memory."""
  by_cfg = {}
  for r in records:
    by_cfg.setdefault((r['model'], r['K'], r['M']), {})[r['impl']] = r

  lines = [
      '| model | K | M | impl | ms | x plain | x unrolled (same M) '
      '| x lingvo | peak RSS MB | RSS - lingvo RSS MB |',
      '|' + '---|' * 10,
  ]
  for (model, k, m), c in by_cfg.items():
    lingvo = c.get('lingvo', {})
    for impl, r in c.items():
      if not impl.startswith('lingvo_ext'):
        continue
      rss_diff = None
      if r.get('peak_rss_mb') is not None and lingvo.get('peak_rss_mb'):
        rss_diff = r['peak_rss_mb'] - lingvo['peak_rss_mb']
      lines.append('| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s |' % (
          model, k, m, impl, Fmt(r['step_ms']),
          Fmt(r.get('vs_plain'), '%.2f'),
          Fmt(r.get('vs_unrolled'), '%.2f'), Fmt(r.get('vs_lingvo'), '%.2f'),
          Fmt(r.get('peak_rss_mb'), '%.0f'), Fmt(rss_diff, '%+.0f')))
  return '\n'.join(lines)


def PrintMarkdown(records: Sequence[Dict]) -> None:
  print(Markdown(records))
  print()
  print(MarkdownSchedules(records))
  if any(r.get('framework') == 'torch' for r in records):
    print()
    print(MarkdownVsTorch(records))
    print()
    print(torch_common.Markdown(records))
