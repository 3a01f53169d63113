r"""Lingvo's own GPipe LM on both engines: time to first step and steps/s.

The experiment is the one of docs/coming-from-lingvo.md, the tests' own
(tests/support/lingvo_lm_testlib.py), written into a temporary directory: Lingvo's `BatchMajorLanguageModel` with
`GPipeTransformerLm.CommonParams(vocab_size=128, model_dim=64,
hidden_dim=128, num_heads=2, num_layers=4, splits=2, num_micro_batches=4)`,
fed by Lingvo's `LmInput` (batch 8, length 16) from a text file. Each round
runs the trainer on it once per engine, in turn:

  .venv/bin/python -m lingvo_ext.trainer --model=lingvo_gpipe_lm.GPipeLmUntrimmed \
      --gpipe_engine=ENGINE --num_cpu_devices=2 --worker_split_size=2 ...

and times, from the process start, its "step 1/" line (time to first step)
and the steps after it (steps/s, from the first to the last progress line).

The benchmark-only device: off TPU, `BatchMajorLanguageModel` trims the
time axis of each batch to its longest sentence, a length known only when
the graph runs, and Lingvo's engine cannot build its pipeline then
(`AssertionError: [2, None]`). The bench runs its twin whose task's
`_TrimIfPossible` keeps the input's fixed length (what Lingvo does on TPU),
on both engines alike; lingvo_ext trains the plain class too. It lives in the
generated experiment only, not in lingvo_ext.

  .venv/bin/python bench/lingvo_lm.py --markdown
  .venv/bin/python bench/lingvo_lm.py --steps 30 --rounds 3 --json

Rounds alternate the engines' order, so load that comes and goes hits both;
take the figures as the ratio of one run. See docs/benchmarks.md ("Lingvo's
GPipe LM on both engines").
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)
from bench import harness  # pylint: disable=g-import-not-at-top,g-bad-import-order
from tests.support import lingvo_lm_testlib  # pylint: disable=g-import-not-at-top,g-bad-import-order

ENGINES = ('lingvo_ext', 'lingvo')
MODEL = lingvo_lm_testlib.UNTRIMMED_MODEL
_STEP = re.compile(r'^step (\d+)/(\d+)\s+loss (\S+)')

def WriteExperiment(directory: str) -> str:
  """Writes the experiment and its text; returns the directory."""
  return lingvo_lm_testlib.Write(directory)


def RunOnce(engine: str, exp_dir: str, steps: int, timeout_s: float = 900,
            python: str = sys.executable) -> dict:
  """One trainer run on `engine`: its first-step time, steps/s, step-1 loss."""
  logdir = tempfile.mkdtemp(prefix='lingvo_lm_bench_%s_' % engine)
  cmd = [python, '-m', 'lingvo_ext.trainer', '--model=' + MODEL,
         '--gpipe_engine=' + engine, '--num_cpu_devices=2',
         '--worker_split_size=2', '--max_steps=%d' % steps,
         '--logdir=' + logdir]
  env = dict(os.environ, PYTHONPATH=exp_dir + os.pathsep + _REPO)
  record = dict(engine=engine, steps=steps)
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  seen, tail = [], []
  try:
    for line in proc.stdout:
      t = time.perf_counter() - t0
      tail = (tail + [line.rstrip()])[-20:]
      m = _STEP.match(line)
      if m:
        seen.append((int(m.group(1)), t, float(m.group(3))))
      if t > timeout_s:
        break
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait()
  if proc.returncode or not seen:
    record['error'] = 'exit %s: %s' % (proc.returncode, ' | '.join(tail[-3:]))
    return record
  first = seen[0]
  last = seen[-1]
  record.update(first_step_s=first[1], loss_1=first[2],
                last_step=last[0], last_loss=last[2])
  if last[0] > first[0] and last[1] > first[1]:
    record['steps_per_s'] = (last[0] - first[0]) / (last[1] - first[1])
  return record


def Run(steps: int = 30, rounds: int = 2, engines=ENGINES) -> list:
  """`rounds` runs per engine, the order alternating each round."""
  exp_dir = WriteExperiment(tempfile.mkdtemp(prefix='lingvo_lm_bench_'))
  records = []
  for r in range(rounds):
    order = list(engines) if r % 2 == 0 else list(reversed(engines))
    for engine in order:
      rec = RunOnce(engine, exp_dir, steps)
      rec['round'] = r
      print(json.dumps(rec), file=sys.stderr, flush=True)
      records.append(rec)
  return records


def Summary(records: list) -> list:
  """Per engine: the median over its rounds, and the ratio to lingvo_ext's
  (lingvo's time to first step / lingvo_ext's; steps/s lingvo_ext's /
  lingvo's: above 1, lingvo_ext is faster)."""
  out = []
  for engine in dict.fromkeys(r['engine'] for r in records):
    runs = [r for r in records if r['engine'] == engine]
    ok = [r for r in runs if 'error' not in r]
    row = dict(engine=engine, runs=len(runs), ok=len(ok))
    if ok:
      row['first_step_s'] = statistics.median(r['first_step_s'] for r in ok)
      rates = [r['steps_per_s'] for r in ok if 'steps_per_s' in r]
      row['steps_per_s'] = statistics.median(rates) if rates else None
      row['loss_1'] = ok[0]['loss_1']
    else:
      row['error'] = runs[0].get('error', 'no run')
    out.append(row)
  base = next((r for r in out if r['engine'] == 'lingvo_ext' and r['ok']),
              None)
  for row in out:
    if base and row['ok'] and row is not base:
      row['first_step_vs_lingvo_ext'] = (row['first_step_s'] /
                                         base['first_step_s'])
      if row['steps_per_s'] and base['steps_per_s']:
        row['lingvo_ext_speedup'] = base['steps_per_s'] / row['steps_per_s']
  return out


def Markdown(summary: list) -> str:
  """The summary as a Markdown table."""
  rows = []
  for r in summary:
    if not r['ok']:
      rows.append((r['engine'], r['runs'], '-', '-', '-',
                   r['error'].replace('|', '/')))
      continue
    vs = []
    if 'first_step_vs_lingvo_ext' in r:
      vs.append('first step x%.2f' % r['first_step_vs_lingvo_ext'])
    if 'lingvo_ext_speedup' in r:
      vs.append("lingvo_ext's steps/s x%.2f" % r['lingvo_ext_speedup'])
    rows.append((r['engine'], r['ok'], '%.1f s' % r['first_step_s'],
                 '-' if r['steps_per_s'] is None else
                 '%.2f' % r['steps_per_s'], '%.4f' % r['loss_1'],
                 ', '.join(vs) or '-'))
  return harness.Table(('engine', 'runs', 'time to first step', 'steps/s',
                        'step-1 loss', 'vs lingvo_ext'), rows)


def ParseArgs(argv):
  parser = harness.Parser(__doc__,
                          markdown_help='Print a markdown table (the default).')
  parser.prog = '.venv/bin/python bench/lingvo_lm.py'
  parser.add_argument('--steps', type=int, default=30,
                      help='Training steps per run (default %(default)s).')
  parser.add_argument('--rounds', type=int, default=2,
                      help='Runs per engine (default %(default)s).')
  parser.add_argument('--engines', nargs='+', default=list(ENGINES),
                      choices=ENGINES, help='Engines (default both).')
  parser.add_argument('--json', action='store_true',
                      help='Print the runs and the summary as JSON.')
  args = parser.parse_args(argv)
  if args.steps < 2 or args.rounds < 1:
    parser.error('--steps must be >= 2 and --rounds >= 1.')
  return args


def main(argv=None) -> int:
  args = ParseArgs(sys.argv[1:] if argv is None else argv)
  records = Run(args.steps, args.rounds, args.engines)
  summary = Summary(records)
  if args.json:
    print(json.dumps(dict(runs=records, summary=summary)))
  else:
    print(Markdown(summary))
  return 0 if all(r['ok'] for r in summary) else 1


if __name__ == '__main__':
  sys.exit(main())
