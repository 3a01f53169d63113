"""The memory model's predicted peak RSS against the trainer's measured one.

Each row trains the experiment with the trainer for a few steps in a fresh
process and reads that process's peak RSS (its VmHWM at exit: lingvo_ext/child_peak.py);
the prediction is start_memory.EstimateRun's with this machine's probed
constants (planner/memory_probe.py). Prints a Markdown table: model, batch,
predicted, measured, error (predicted / measured - 1) and the largest terms.

  .venv/bin/python -m bench.memory --num_cpu_devices=2 \\
      --runs='lm.TransformerLmGPipe:64,128,256,512'
"""

import argparse
import subprocess
import sys
import tempfile


def MeasuredPeak(model: str, overrides: str, devices: int, steps: int,
                 extra=()) -> float:
  """The trainer process's peak RSS in bytes (its own VmHWM at exit)."""
  from lingvo_ext import child_peak  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as logdir:
    args = [f'--model={model}', f'--logdir={logdir}',
            f'--num_cpu_devices={devices}', f'--worker_split_size={devices}',
            f'--max_steps={steps}', f'--model_params_override={overrides}',
            *extra]
    code, peak = child_peak.Run('lingvo_ext.trainer', args,
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    if code or peak is None:
      raise RuntimeError(f'lingvo_ext.trainer {" ".join(args)}: exit {code}')
  return float(peak)


def Predicted(model: str, overrides: str, devices: int):
  from absl import flags  # pylint: disable=g-import-not-at-top

  from lingvo_ext.preflight import start_memory  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    # Lingvo's task params (an MT model's) read absl flags when built.
    flags.FLAGS(sys.argv[:1], known_only=True)
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  cfg = experiment_params.GetParams(model, 'Train', overrides)
  return start_memory.EstimateRun(cfg, devices, devices)


def main(argv):
  ap = argparse.ArgumentParser()
  ap.add_argument('--num_cpu_devices', type=int, default=2)
  ap.add_argument('--steps', type=int, default=6)
  ap.add_argument('--runs', default='lm.TransformerLmGPipe:64,128,256,512',
                  help="'model:b1,b2 model2:b3' (batch sizes; empty: the "
                  "experiment's own).")
  ap.add_argument('--batch_param', default='input.batch_size')
  ap.add_argument('--override', default='',
                  help='More --model_params_override, after the batch.')
  args = ap.parse_args(argv)
  mb = 2.**20
  print('| model | batch | predicted | measured | error | largest terms |')
  print('|---|---|---|---|---|---|')
  for run in args.runs.split():
    model, _, batches = run.partition(':')
    for b in (batches.split(',') if batches else ['']):
      over = '; '.join(x for x in (
          f'{args.batch_param}:{b}' if b else '', args.override) if x)
      got = Predicted(model, over, args.num_cpu_devices)
      measured = MeasuredPeak(model, over, args.num_cpu_devices, args.steps)
      terms = sorted(got.rss_terms.items(), key=lambda kv: -kv[1])[:3]
      text = ', '.join(f'{k} {v / mb:.0f}' for k, v in terms)
      print(f'| {model} | {b or "default"} {args.override} | {got.rss_bytes / mb:.0f} MB | '
            f'{measured / mb:.0f} MB | '
            f'{got.rss_bytes / measured - 1:+.1%} | {text} |', flush=True)


if __name__ == '__main__':
  main(sys.argv[1:])
