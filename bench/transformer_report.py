"""bench/transformer.py's tables: its records as markdown (variants,
dtypes, the ladder against the GEMM floor)."""

# The default sizes (bench/transformer.py's flags of the same names).
SIZES = T, B, D, HIDDEN, HEADS, VOCAB = 16, 32, 64, 128, 2, 32


# The floor's pseudo-variant: the step's matmuls at this machine's pace.
FLOOR = 'floor'


DTYPES = ('float32', 'bfloat16')


def LossLabel(record) -> str:
  """What a row's variant name adds for the loss placement."""
  return ', loss in last cell' if record.get('loss') == 'last_cell' else ''


def MarkdownDtypes(records) -> str:
  """bf16 beside float32 per configuration and variant."""
  by = {}
  for r in records:
    if 'error' not in r:
      name = r['variant'] + LossLabel(r)
      by.setdefault((r['L'], r['K'], r['M'], name, Sizes(r)),
                    {})[r.get('dtype', 'float32')] = r
  rows = ['| L, K, M | variant | float32 ms | bf16 ms | bf16 / float32 | '
          'bytes between cells float32 / bf16 | op time: MatMul ms float32 / '
          'bf16 | Cast ms bf16 | all ops ms float32 / bf16, calls excluded | '
          'MatMul share float32 | ops run float32 / bf16 | oneDNN |',
          '|---|---|---|---|---|---|---|---|---|---|---|---|']
  for (l, k, m, v, _), d in by.items():
    if set(DTYPES) <= set(d) and v != FLOOR and not v.startswith('torch'):
      f, b = d['float32'], d['bfloat16']
      rows.append('| %d, %d, %d | %s | %.1f | %.1f | %.2fx | %d / %d | '
                  '%.1f / %.1f | %.1f | %.1f / %.1f | %s | %s / %s | %s |' %
                  (l, k, m, v, f['step_ms'], b['step_ms'],
                   b['step_ms'] / f['step_ms'], f['bytes_between_cells'],
                   b['bytes_between_cells'], f['matmul_ms'], b['matmul_ms'],
                   b['cast_ms'], f['op_ms'], b['op_ms'],
                   '%.0f%%' % (100 * f['matmul_ms'] / f['op_ms'])
                   if f['op_ms'] else '-', f['ops_run'], b['ops_run'],
                   OneDnnCell(b)))
  return '\n'.join(rows)


def OneDnnCell(record) -> str:
  """A bf16 table's oneDNN column: on or off, and a CPU without bf16 units.

  (bench/pipeline.py's bf16 table too.)
  """
  return ('on' if record['onednn'] else 'off') + (
      ', CPU without bf16 units' if record.get('cpu_bf16_units') is False
      else '')


def Sizes(r) -> tuple:
  """(d_model, hidden, seq, batch, heads) of a record (torch's too)."""
  def get(a, b, default):
    return r.get(a, r.get(b, default))

  return (get('d_model', 'model_dim', D), r.get('hidden', HIDDEN),
          get('seq', 'time_steps', T), r.get('batch', B), r.get('heads', HEADS))


def Fastest(rounds) -> list:
  """Per configuration, the record of its fastest round (Run's record lists
  of one bench, timed in turn), with every round's `step_ms_rounds`: on a
  shared machine the least disturbed round of the step and of its floor."""
  best, order = {}, []
  for records in rounds:
    for r in records:
      key = (r['variant'], r.get('dtype', 'float32'), r['L'], r['K'], r['M'],
             r.get('loss', 'after'), Sizes(r))
      if key not in best:
        order.append(key)
        best[key] = dict(r, step_ms_rounds=[])
      if 'error' in r:
        continue
      kept = best[key]
      times = kept['step_ms_rounds'] + [r['step_ms']]
      if 'error' in kept or r['step_ms'] < kept['step_ms']:
        best[key] = kept = dict(r)
      kept['step_ms_rounds'] = times
  return [best[k] for k in order]


def MarkdownLadder(records) -> str:
  """Per sizes, (L, K, M) and dtype: the floor and each column as a
  multiple of it (the issue's size ladder)."""
  groups = {}
  for r in records:
    if 'error' in r:
      continue
    key = (Sizes(r), r['L'], r['K'], r['M'], r.get('dtype', 'float32'))
    groups.setdefault(key, []).append(r)
  rows = ['| d_model, hidden, T, B, heads | L, K, M | dtype | GEMM floor ms '
          '(GFLOP, GFLOP/s) | default ms (x floor) | best build ms (x floor) '
          '| torch eager ms (x floor) | default / torch eager | torch GPipe / '
          '1F1B ms (x floor) | Lingvo ms (x floor) | default / float32 '
          'default |', '|---|---|---|---|---|---|---|---|---|---|---|']

  def _Cell(r, floor):
    if r is None:
      return '-'
    if floor is None:
      return '%.1f' % r['step_ms']
    return '%.1f (%.2fx)' % (r['step_ms'], r['step_ms'] / floor['step_ms'])

  for key, rs in groups.items():
    sizes, l, k, m, dtype = key
    by = {}
    for r in rs:
      # torch's pipelines always have the loss in the last stage.
      by.setdefault(r['variant'] + (
          '' if r['variant'].startswith('torch') else LossLabel(r)), r)
    floor = by.get(FLOOR)
    default = by.get('unrolled')
    ext = [(n, r) for n, r in by.items() if n != FLOOR and n != 'lingvo'
           and not n.startswith('torch')]
    best_name, best = min(ext, key=lambda x: x[1]['step_ms'],
                          default=(None, None))
    eager = by.get('torch/plain')
    f32 = [r for r in groups.get((sizes, l, k, m, 'float32'), [])
           if r['variant'] == 'unrolled' and r.get('loss') == 'after']
    pipes = [by.get('torch/gpipe'), by.get('torch/1f1b')]
    rows.append('| %s | %d, %d, %d | %s | %s | %s | %s | %s | %s | %s | %s | '
                '%s |' % (
                    ', '.join(str(x) for x in sizes), l, k, m, dtype,
                    '%.1f (%.3g, %.1f)' % (floor['step_ms'],
                                           floor['matmul_gflop'],
                                           floor['peak_gflops'])
                    if floor else '-',
                    _Cell(default, floor),
                    '-' if best is None else '%s: %s' % (best_name,
                                                         _Cell(best, floor)),
                    _Cell(eager, floor),
                    '%.2fx' % (default['step_ms'] / eager['step_ms'])
                    if default and eager else '-',
                    ' / '.join(_Cell(p, floor) for p in pipes)
                    if any(pipes) else '-',
                    _Cell(by.get('lingvo'), floor),
                    '%.2fx' % (default['step_ms'] / f32[0]['step_ms'])
                    if default and f32 and dtype != 'float32' else '-'))
  return '\n'.join(rows)


def Markdown(records) -> str:
  """One row per configuration and variant, with ratios to Lingvo's and to
  the default schedule's ('unrolled', same dtype and loss placement)."""
  rows = ['| L, K, M | variant | graph ops | first step (s) | step (ms) | '
          'CPU ms a step | peak RSS (MB) | ops run | step / Lingvo | '
          'step / unrolled |',
          '|---|---|---|---|---|---|---|---|---|---|']

  def _Key(r):
    return (r['L'], r['K'], r['M'], Sizes(r), r.get('dtype', 'float32'),
            r.get('loss', 'after'))

  ok = [r for r in records if 'error' not in r]
  base = {_Key(r)[:5]: r for r in ok if r.get('variant') == 'lingvo'}
  default = {_Key(r): r for r in ok if r.get('variant') == 'unrolled'}
  for r in records:
    if r.get('variant') == FLOOR:
      continue  # MarkdownLadder's.
    key = (r['L'], r['K'], r['M'])
    dtype = r.get('dtype', 'float32')
    name = r['variant'] + (' (%s)' % dtype if dtype != 'float32' else '') + (
        LossLabel(r)) + ('' if Sizes(r)[0] == D else ', d_model %d' %
                          Sizes(r)[0])
    if 'error' in r:
      rows.append('| %d, %d, %d | %s | %s | | | | | | | |' %
                  (*key, name, r['error']))
      continue
    ratios = []
    for refs, ref_key in ((base, _Key(r)[:5]), (default, _Key(r))):
      ratios.append('%.2fx' % (r['step_ms'] / refs[ref_key]['step_ms'])
                    if ref_key in refs else '')
    cpu = r.get('cpu_ms')
    rows.append('| %d, %d, %d | %s | %s | %.1f | %.1f | %s | %d | %s | %s | '
                '%s |' %
                (*key, name,
                 '-' if r.get('ops') is None else r['ops'],
                 r['first_step_s'], r['step_ms'],
                 '-' if cpu is None else '%.0f' % cpu, r['peak_rss_mb'],
                 r.get('ops_run', '-'), *ratios))
  return '\n'.join(rows)
