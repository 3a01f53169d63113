"""Time to the first step: the trainer against the least a process can do.

For each experiment, side by side in one run:

- 'lingvo_ext.trainer': `python -m lingvo_ext.trainer --model=... --max_steps=1`
  from process start to its "step 1/" progress line;
- 'script': a fresh process that imports lingvo_ext, builds the same
  registered experiment's task once (FProp, backward, update, as the trainer
  does under its cluster), initialises and runs one step: the floor a
  trainer run is held to, with its breakdown (imports, params, graph build,
  first Session.run: placement, Grappler, initialisation);
- 'lingvo.trainer': Lingvo's own trainer (its RunnerManager, Controller and
  Trainer, lingvo_ext's experiments registered) on the same experiment, from
  process start to its 'step:     1,' log line, where it can run it (one CPU
  device: not with --num_cpu_devices);
- 'transformer' rows (--transformer_layers): Lingvo's GPipeTransformerStack
  at L layers, K=4 cells, M=16 micro-batches, built by lingvo.core.gpipe
  ('lingvo') and by lingvo_ext ('unrolled') as bench/transformer.py does.

  .venv/bin/python bench/startup.py --markdown
  .venv/bin/python bench/startup.py --models lm.TransformerLmTiny \\
      --transformer_layers 0          # one small experiment only
  .venv/bin/python bench/startup.py --rounds 4 --transformer_layers 0
                                      # medians of 4 runs each, in turn

Times are wall seconds of one run each (with --rounds N, medians of N):
take them side by side, on an idle machine where you can. See
docs/benchmarks.md ("Start-up").
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

_START = time.time()
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)
from bench import harness  # pylint: disable=g-import-not-at-top,g-bad-import-order

# (experiment, its trainer flags): the default model and a GPipe one.
DEFAULT_MODELS = (
    ('lm.TransformerLm', ()),
    ('lm.TransformerLmTinyGPipe', ('--num_cpu_devices=2',
                                   '--worker_split_size=2')),
)
_FIRST_STEP = re.compile(r'^step 1/')
# Lingvo's trainer logs its status after the first step.
_LINGVO_FIRST_STEP = re.compile(r'.*\] step:\s+1, ')


def _Flag(flags, name, default):
  for f in flags:
    if f.startswith('--%s=' % name):
      return int(f.split('=', 1)[1])
  return default


def _Script(model: str, flags) -> dict:
  """Builds and runs one step of `model` in this process, timed by stage."""
  t = time.time()
  sys.path.insert(0, _REPO)
  from lingvo_ext import entry_point  # pylint: disable=g-import-not-at-top,unused-import
  # isort: split
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  py_utils.SetEagerMode(False)
  out = dict(imports_s=time.time() - t)
  t = time.time()
  params = experiment_params.GetParams(model, 'Train')
  out['params_s'] = time.time() - t
  t = time.time()
  devices = _Flag(flags, 'num_cpu_devices', 1)
  split = _Flag(flags, 'worker_split_size', 1)
  graph = tf.Graph()
  with graph.as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=devices, split_size=split):
    model_obj = params.Instantiate()
    model_obj.ConstructFPropBPropGraph()
    task = model_obj.GetTask()
    init = [tf.global_variables_initializer(), tf.local_variables_initializer(),
            tf.tables_initializer()]
  out['build_s'] = time.time() - t
  t = time.time()
  config = py_utils.SessionConfig()
  config.device_count['CPU'] = devices
  with tf.Session(graph=graph, config=config) as sess:
    sess.run(init)
    task.input.Initialize(sess)
    sess.run(task.train_op)
  out['first_run_s'] = time.time() - t
  out['process_s'] = time.time() - _START
  return {k: round(v, 2) for k, v in out.items()}


def _LingvoTrainer(model, logdir):
  """Runs Lingvo's trainer main on `model` (as `python -m lingvo.trainer`)."""
  sys.path.insert(0, _REPO)
  from lingvo_ext import entry_point  # pylint: disable=g-import-not-at-top,unused-import
  # isort: split
  from lingvo import trainer as lingvo_trainer  # pylint: disable=g-import-not-at-top
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  # Registers the experiments; Lingvo's model_registry finds them.
  import params  # pylint: disable=g-import-not-at-top,unused-import
  flags = tf.flags.FLAGS
  flags(['lingvo.trainer', '--model=' + model, '--logdir=' + logdir,
         '--run_locally=cpu', '--mode=sync', '--logtostderr'],
        known_only=True)
  if flags.disable_tf2:
    tf.disable_v2_behavior()
  py_utils.SetEagerMode(flags.use_eager)
  tf.app.run(lingvo_trainer.main, argv=['lingvo.trainer'])


def _TimeToFirstStep(cmd, timeout_s, pattern=_FIRST_STEP, stop=False):
  """(seconds to the first line matching `pattern` or None, exit code, output).

  Timed when the line arrives, not at exit: the session's teardown is not
  start-up. stop: kill the command then (it would train on).
  """
  start = time.time()
  first = None
  lines = []
  with subprocess.Popen(cmd, cwd=_REPO, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        text=True, start_new_session=True) as proc:
    try:
      for line in proc.stdout:
        lines.append(line)
        if first is None and pattern.match(line):
          first = time.time() - start
          if stop:
            break
        if time.time() - start > timeout_s:
          break
      if stop and first is not None:
        os.killpg(proc.pid, 9)
      proc.wait(max(1, timeout_s - (time.time() - start)))
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()
  return first, (0 if stop and first else proc.returncode), lines


def _Error(code, lines):
  last = [l for l in lines if l.strip()][-1:] or ['']
  return 'exit %s: %s' % (code, last[0].strip()[:200])


def TrainerRecord(model, flags, timeout_s=1800) -> dict:
  with tempfile.TemporaryDirectory(prefix='startup_') as logdir:
    cmd = [sys.executable, '-m', 'lingvo_ext.trainer', '--model=' + model,
           '--max_steps=1', '--logdir=' + logdir] + list(flags)
    first, code, lines = _TimeToFirstStep(cmd, timeout_s)
  rec = dict(engine='lingvo_ext.trainer', model=model, flags=' '.join(flags),
             first_step_s=None if first is None else round(first, 2))
  if code != 0 or first is None:
    rec['error'] = _Error(code, lines)
  return rec


def LingvoTrainerRecord(model, flags, timeout_s=1800) -> dict:
  rec = dict(engine='lingvo.trainer', model=model, flags=' '.join(flags))
  if flags:
    rec['error'] = 'not run: Lingvo\'s trainer has one CPU device'
    return rec
  with tempfile.TemporaryDirectory(prefix='startup_') as logdir:
    cmd = [sys.executable, os.path.abspath(__file__), '--_lingvo_child', model,
           '--child_flag=--logdir=' + logdir]
    first, code, lines = _TimeToFirstStep(cmd, timeout_s, _LINGVO_FIRST_STEP,
                                          stop=True)
  rec['first_step_s'] = None if first is None else round(first, 2)
  if code != 0 or first is None:
    rec['error'] = _Error(code, lines)
  return rec


def ScriptRecord(model, flags, timeout_s=1800) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), '--_child', model] + [
      '--child_flag=' + f for f in flags]
  first, code, lines = _TimeToFirstStep(cmd, timeout_s, re.compile(r'^\{'))
  rec = dict(engine='script', model=model, flags=' '.join(flags))
  if code != 0 or first is None:
    rec['error'] = _Error(code, lines)
    return rec
  rec.update(json.loads([l for l in lines if l.startswith('{')][0]))
  rec['first_step_s'] = round(first, 2)
  return rec


def TransformerRecords(layers, timeout_s=3600):
  """bench/transformer.py's L-layer, K=4, M=16 stack, Lingvo's and ours."""
  sys.path.insert(0, _REPO)
  from bench import transformer  # pylint: disable=g-import-not-at-top
  out = []
  for variant in ('lingvo', 'unrolled'):
    cmd = [sys.executable, os.path.join(_REPO, 'bench', 'transformer.py'),
           '--_child', variant, '--L', str(layers), '--K', '4', '--M', '16',
           '--steps', '1']
    start = time.time()
    proc = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)
    wall = time.time() - start
    rec = dict(engine='transformer/' + variant, model='L=%d K=4 M=16' % layers,
               flags='')
    if proc.returncode != 0:
      rec['error'] = _Error(proc.returncode, proc.stderr.splitlines())
    else:
      r = json.loads(proc.stdout.strip().splitlines()[-1])
      rec.update(imports_s=r['import_s'], build_s=r['build_s'],
                 # bench/transformer.py's first_step_s counts from the build.
                 first_run_s=round(r['first_step_s'] - r['build_s'], 2),
                 first_step_s=round(r['import_s'] + r['first_step_s'], 2),
                 process_s=round(wall, 2))
    out.append(rec)
  del transformer
  return out


def WithRatios(records):
  """Adds the ratios of first_step_s: vs_script, vs_lingvo.

  The trainer's over the script's and over Lingvo's trainer's on the same
  experiment; the unrolled transformer's over Lingvo's gpipe.
  """
  by = {(r['engine'], r['model']): r for r in records}
  pairs = {'lingvo_ext.trainer': (('script', 'vs_script'),
                                  ('lingvo.trainer', 'vs_lingvo')),
           'transformer/unrolled': (('transformer/lingvo', 'vs_lingvo'),)}
  for r in records:
    if r.get('first_step_s') is None:
      continue
    for engine, key in pairs.get(r['engine'], ()):
      base = by.get((engine, r['model']))
      if base and base.get('first_step_s'):
        r[key] = round(r['first_step_s'] / base['first_step_s'], 3)
  return records


def _Fmt(v):
  return '-' if v is None else ('%.2f' % v if isinstance(v, float) else
                                str(v))


def Markdown(records):
  cols = ('engine', 'model', 'flags', 'first_step_s', 'imports_s', 'params_s',
          'build_s', 'first_run_s', 'vs_script', 'vs_lingvo')
  return harness.Table(cols, [
      [r['engine'], r['model'], r['flags'], r['error']] + [''] *
      (len(cols) - 4) if 'error' in r else [_Fmt(r.get(c)) for c in cols]
      for r in records])


def _Median(values):
  return round(statistics.median(values), 3)


def _Rounds(model, flags, rounds, emit):
  """The model's records over `rounds` rounds, each engine's median.

  Each round runs the engines in turn, starting one later each round (a
  machine whose speed drifts weighs on all alike); ratios are the medians
  of each round's ratios.
  """
  measures = [ScriptRecord, TrainerRecord]
  if not flags:  # Lingvo's trainer has one CPU device.
    measures.append(LingvoTrainerRecord)
  runs = []
  for i in range(rounds):
    order = measures[i % len(measures):] + measures[:i % len(measures)]
    got = {m: m(model, flags) for m in order}
    for m in order:
      emit(got[m])
    runs.append(WithRatios([got[m] for m in measures]))
  if rounds == 1:
    return runs[0]
  out = []
  for k in range(len(measures)):
    recs = [run[k] for run in runs]
    failed = [r for r in recs if 'error' in r]
    rec = dict(failed[0] if failed else recs[0], rounds=rounds)
    if not failed:
      for key, value in recs[0].items():
        if isinstance(value, float):
          # A ratio is missing from a round whose other engine failed.
          rec[key] = _Median([r[key] for r in recs if key in r])
    out.append(rec)
  return out


def Run(models, transformer_layers, emit=lambda r: None, rounds=1):
  """All records, ratios added; `emit` sees each as it is measured.

  With rounds > 1 each experiment's engines run `rounds` times in turn and
  each record holds the medians (`_Rounds`).
  """
  records = []
  for model, flags in models:
    records += _Rounds(model, flags, rounds, emit)
  for layers in transformer_layers:
    pair = TransformerRecords(layers)
    for r in pair:
      emit(r)
    records += WithRatios(pair)
  return records


def main(argv=None):
  parser = harness.Parser(__doc__)
  parser.add_argument(
      '--models', nargs='+',
      help='Registered experiments, run with no extra flags (default: '
      'lm.TransformerLm, and lm.TransformerLmTinyGPipe on 2 devices).')
  parser.add_argument('--transformer_layers', type=int, nargs='+',
                      default=[32], help='L of the transformer rows; 0: none.')
  parser.add_argument('--rounds', type=int, default=1,
                      help='Runs of each experiment\'s engines, in turn; '
                      'each figure the median.')
  parser.add_argument('--_child', help=argparse.SUPPRESS)
  parser.add_argument('--_lingvo_child', help=argparse.SUPPRESS)
  parser.add_argument('--child_flag', action='append', default=[],
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args._child:  # pylint: disable=protected-access
    print(json.dumps(_Script(args._child, args.child_flag)), flush=True)  # pylint: disable=protected-access
    return 0
  if args._lingvo_child:  # pylint: disable=protected-access
    logdir = args.child_flag[0].split('=', 1)[1]
    _LingvoTrainer(args._lingvo_child, logdir)  # pylint: disable=protected-access
    return 0
  if any(l < 0 for l in args.transformer_layers):
    parser.error('--transformer_layers must be >= 0.')
  if args.rounds < 1:
    parser.error('--rounds must be >= 1.')
  models = ([(m, ()) for m in args.models] if args.models else
            list(DEFAULT_MODELS))
  # Each record as it comes on stderr: a long run's measurements are not
  # lost with it.
  records = Run(models, [l for l in args.transformer_layers if l],
                emit=lambda r: print('[bench] ' + json.dumps(r),
                                     file=sys.stderr, flush=True),
                rounds=args.rounds)
  harness.Emit(args, records, Markdown)
  return 0


if __name__ == '__main__':
  sys.exit(main())
