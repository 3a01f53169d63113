"""bench/plan.py's report: the summary record of a model's sweep, its
re-prediction by this checkout's planner, and the markdown tables.

Pure Python over the records bench/plan.py writes (its --jsonl); the
planner's own modules only.
"""

import dataclasses
import math
import statistics
from typing import Callable
from typing import Dict
from typing import List
from typing import Sequence

from lingvo_ext import planner
from lingvo_ext.planner import measuring


def _Ranks(xs: Sequence[float]) -> List[float]:
  order = sorted(range(len(xs)), key=lambda i: xs[i])
  ranks = [0.] * len(xs)
  i = 0
  while i < len(order):
    j = i
    while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
      j += 1
    for k in range(i, j + 1):
      ranks[order[k]] = (i + j) / 2.
    i = j + 1
  return ranks


def Spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
  """Spearman's rank correlation (average ranks for ties)."""
  if len(xs) != len(ys) or len(xs) < 2:
    raise ValueError('Spearman needs two equal-length lists of >= 2 values.')
  rx, ry = _Ranks(xs), _Ranks(ys)
  mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
  cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
  vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
  vy = math.sqrt(sum((b - my) ** 2 for b in ry))
  return cov / (vx * vy) if vx and vy else 0.


def XlaMarkdown(records: Sequence[Dict]) -> str:
  out = ['| model | plan | XLA / no XLA predicted | measured | faster '
         'build predicted |', '|---|---|---|---|---|']
  for r in records:
    for row in r['rows']:
      out.append('| %s | %s | %.2f | %.2f | %s |' % (
          r['model'], row['plan'], row['predicted_ratio'],
          row['measured_ratio'], 'yes' if row['agree'] else 'no'))
  return '\n'.join(out)


def Summary(model: str, devices: int, plans: Sequence[planner.Plan],
            machine: planner.Machine, measure: Dict, **fields) -> Dict:
  """The summary record of a model's predicted and measured plans.

  Args:
    model: The model's name.
    devices: N.
    plans: Predicted plans with their measured_step_s and measured_rss_bytes.
    machine: The calibrated machine they were predicted with.
    measure: chosen_measure_key (the --measure pick), measure_noise,
      measure_candidates and their measure_rounds_ms; or {} where there was
      no re-timing.
    **fields: Recorded as they are (probe, reference_ms, ...).
  """
  best = min(p.measured_step_s for p in plans)
  chosen = planner.Rank(plans)[0]
  by_key = {p.Key(): p for p in plans}
  with_rss = [p for p in plans if p.measured_rss_bytes]
  # The memory model's peak RSS (RunModel's predicted_rss) where recorded,
  # else the planner's process total.
  rss = fields.get('predicted_rss') or {}
  mem_err = [abs(rss.get(p.Key(), p.process_bytes) - p.measured_rss_bytes) /
             p.measured_rss_bytes for p in with_rss]
  step_err = [abs(p.step_s - p.measured_step_s) / p.measured_step_s
              for p in plans]
  # The memory model's runtime term is a trainer's (memory_probe); the sweep
  # measures a fork server's child: its own runtime (RunModel's
  # bench_runtime_mb) in the model's place checks the other terms.
  shift = 0.
  if rss and fields.get('runtime_mb') and fields.get('bench_runtime_mb'):
    shift = 2**20 * (fields['bench_runtime_mb'] - fields['runtime_mb'])
    own_err = [abs(rss[p.Key()] + shift - p.measured_rss_bytes) /
               p.measured_rss_bytes for p in with_rss if p.Key() in rss]
  out = dict(
      model=model, devices=devices, plans=len(plans),
      spearman=round(Spearman([p.step_s for p in plans],
                                      [p.measured_step_s for p in plans]), 3),
      step_err_mean=round(statistics.mean(step_err), 4),
      step_err_max=round(max(step_err), 4),
      mem_err_mean=round(statistics.mean(mem_err), 4),
      mem_err_max=round(max(mem_err), 4),
      mem_err_signed_mean=round(statistics.mean(
          (rss.get(p.Key(), p.process_bytes) - p.measured_rss_bytes) /
          p.measured_rss_bytes for p in with_rss), 4),
      best_key=min(plans, key=lambda p: p.measured_step_s).Key(),
      best_ms=round(1e3 * best, 2),
      chosen_key=chosen.Key(),
      chosen_ms=round(1e3 * chosen.measured_step_s, 2),
      chosen_over_best=round(chosen.measured_step_s / best, 3))
  if shift and own_err:
    out.update(mem_err_own_runtime_mean=round(statistics.mean(own_err), 4),
               mem_err_own_runtime_max=round(max(own_err), 4))
  if measure:
    picked = by_key[measure['chosen_measure_key']]
    out.update(measure,
               chosen_measure_ms=round(1e3 * picked.measured_step_s, 2),
               chosen_measure_over_best=round(picked.measured_step_s / best,
                                              3))
  # The same ratios from the side-by-side timing (RunModel), where it has
  # the plan.
  side = fields.get('side_by_side_ms') or {}
  if side:
    fastest = min(side.values())
    out['side_best_key'] = min(side, key=side.get)
    for name, key in (('chosen', out['chosen_key']),
                      ('chosen_measure', out.get('chosen_measure_key'))):
      if key in side:
        out[name + '_side_over_best'] = round(side[key] / fastest, 3)
    # Whether cutting pays: the fastest side-by-side plan of more than one
    # cell over that of one (where both were timed).
    cells = {k: by_key[k].num_cells for k in side if k in by_key}
    one = [k for k in cells if cells[k] == 1]
    more = [k for k in cells if cells[k] > 1]
    if one and more:
      one, more = min(one, key=side.get), min(more, key=side.get)
      out.update(side_one_cell_key=one, side_more_cells_key=more,
                 side_more_over_one_cell=round(side[more] / side[one], 3))
  out.update(fields, machine=dataclasses.asdict(machine))
  out['rows'] = [dict(key=p.Key(), sizes=list(p.sizes),
                      predicted_ms=round(1e3 * p.step_s, 2),
                      measured_ms=round(1e3 * p.measured_step_s, 2),
                      bubble=round(p.bubble, 3),
                      predicted_peak_mb=round(p.peak_bytes / 2**20, 2),
                      predicted_process_mb=round(p.process_bytes / 2**20, 1),
                      predicted_rss_mb=(round(rss[p.Key()] / 2**20, 1)
                                        if p.Key() in rss else None),
                      measured_rss_mb=(round(p.measured_rss_bytes / 2**20, 1)
                                       if p.measured_rss_bytes else None),
                      comm_kb=round(p.comm_bytes / 1024, 1))
                 for p in sorted(plans, key=lambda p: p.measured_step_s)]
  return out


def Repredict(record: Dict,
              profile_of: Callable[[str], planner.ModelProfile],
              refs_of=None) -> Dict:
  """A saved summary record predicted again by this checkout's planner.

  The model's profile, and the run's own probe and reference measurements
  calibrated again (planner.Calibrate), predict every plan of the run; the
  measured figures are the run's. The --measure pick needs a re-timing: it
  is kept where this planner ranks the same candidates first, else dropped.
  `profile_of(model)` is the model's profile (bench/plan.py's Profile),
  `refs_of(model, profile, devices)` its references (bench/plan.py's
  ReferencePlans; default planner.ReferencePlans).
  """
  profile = profile_of(record['model'])
  refs = (refs_of(record['model'], profile, record['devices']) if refs_of
          else planner.ReferencePlans(profile, devices=record['devices']))
  if 'reference_keys' not in record:
    # Runs before reference_keys were recorded timed 'unrolled' at the
    # 'recurrent' reference's M.
    refs[1] = dataclasses.replace(
        refs[1], num_micro_batches=refs[2].num_micro_batches)
  elif record['reference_keys'] != [p.Key() for p in refs][
      :len(record['reference_keys'])]:
    raise ValueError('--repredict: the run measured the references %s; '
                     'this checkout\'s are %s.' % (
                         record['reference_keys'], [p.Key() for p in refs]))
  machine = planner.Calibrate(
      profile, planner.Machine(**record['probe']),
      [t / 1e3 for t in record['reference_ms']],
      [m * 2**20 for m in record['reference_rss_mb']] or None, refs)
  offered = {p.Key(): p for p in planner.Enumerate(profile,
                                                   record['devices'])}
  plans = []
  for row in record['rows']:
    plan = offered[row['key']]
    plans.append(planner.Candidate(
        plan, planner.Predict(profile, plan, machine), planner.Measurement(
            step_s=row['measured_ms'] / 1e3,
            rss_bytes=(row['measured_rss_mb'] * 2**20
                       if row['measured_rss_mb'] else None))))
  measure = {}
  retimed = record.get('measure_candidates', [])
  ranked = planner.Rank(plans)
  # Runs before measure_within was recorded re-timed the top n.
  within = record.get('measure_within', float('inf'))
  tops = ([record['measure_top']] if 'measure_top' in record else
          range(1, len(retimed) + 1))
  if 'chosen_measure_key' in record and any(
      [p.Key() for p in measuring.MeasureCandidates(ranked, n, within)] ==
      retimed for n in tops):
    measure = {k: record[k] for k in ('chosen_measure_key', 'measure_noise',
                                      'measure_candidates', 'measure_top',
                                      'measure_within', 'measure_rounds_ms')
               if k in record}
  keep = ('probe', 'reference_keys', 'reference_ms', 'reference_rss_mb',
          'seconds', 'side_by_side_ms', 'predicted_rss', 'runtime_mb',
          'bench_runtime_mb')
  return Summary(record['model'], record['devices'], plans, machine, measure,
                 **{k: record[k] for k in keep if k in record})


def _Percent(r: Dict, name: str) -> str:
  """'mean / max' of r's name_mean and name_max, or '-'."""
  if name + '_mean' not in r:
    return '-'
  return '%.1f%% / %.1f%%' % (100 * r[name + '_mean'], 100 * r[name + '_max'])


def Markdown(records: Sequence[Dict]) -> str:
  lines = [
      '| model | plans | Spearman (step time) | step error mean / max '
      '| peak RSS error mean / max (signed mean) '
      '| the same, the sweep\'s runtime '
      '| chosen (predicted) | x best: sweep / side by side '
      '| chosen (--measure) | x best: sweep / side by side '
      '| best: sweep / side by side '
      '| more cells / 1 cell, side by side |',
      '|' + '---|' * 12,
  ]

  def Side(r, name):
    value = r.get(name + '_side_over_best')
    return '-' if value is None else '%.2f' % value

  for r in records:
    measured = '- | -'  # No re-timing (a re-prediction that ranks others).
    if 'chosen_measure_key' in r:
      measured = '%s, %.1f ms | %.2f / %s' % (
          r['chosen_measure_key'], r['chosen_measure_ms'],
          r['chosen_measure_over_best'], Side(r, 'chosen_measure'))
    mem = _Percent(r, 'mem_err')
    if 'mem_err_signed_mean' in r:
      mem += ' (%+.1f%%)' % (100 * r['mem_err_signed_mean'])
    cells = '-'
    if 'side_more_over_one_cell' in r:
      cells = '%.2f (%s / %s)' % (r['side_more_over_one_cell'],
                                  r['side_more_cells_key'],
                                  r['side_one_cell_key'])
    lines.append('| %s | %d | %.2f | %s | %s | %s | %s, %.1f ms '
                 '| %.2f / %s | %s | %s, %.1f ms / %s | %s |' % (
                     r['model'], r['plans'], r['spearman'],
                     _Percent(r, 'step_err'), mem,
                     _Percent(r, 'mem_err_own_runtime'),
                     r['chosen_key'], r['chosen_ms'], r['chosen_over_best'],
                     Side(r, 'chosen'), measured, r['best_key'],
                     r['best_ms'], r.get('side_best_key', '-'), cells))
  for r in records:
    runtime = ''
    if r.get('runtime_mb') and r.get('bench_runtime_mb'):
      runtime = ('; the memory model\'s runtime %.0f MB, the sweep\'s '
                 'process\'s %.0f MB' % (r['runtime_mb'],
                                           r['bench_runtime_mb']))
    lines += ['', '%s (N=%d): per plan, fastest measured first%s' %
              (r['model'], r['devices'], runtime), '',
              '| plan | cut | predicted ms | measured ms | bubble '
              '| predicted RSS MB | planner\'s process MB '
              '| measured RSS MB |',
              '|' + '---|' * 8]
    for row in r['rows']:
      predicted = row.get('predicted_rss_mb')
      lines.append('| %s | %s | %.1f | %.1f | %.0f%% | %s | %.0f | %s |' % (
          row['key'], '+'.join(map(str, row['sizes'])), row['predicted_ms'],
          row['measured_ms'], 100 * row['bubble'],
          '-' if predicted is None else '%.0f' % predicted,
          row['predicted_process_mb'],
          '-' if row['measured_rss_mb'] is None else
          '%.0f' % row['measured_rss_mb']))
  return '\n'.join(lines)
