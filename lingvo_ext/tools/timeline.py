r"""Draws a pipeline's per-device timeline: planned, or measured in training.

Planned: a schedule's action lists (`lingvo_ext.pipeline.schedules`) for K cells,
M micro-batches and D devices, simulated with unit costs (forward 1,
backward 2), with its idle fraction:

  .venv/bin/lingvo-ext-timeline --schedule=1f1b --num_stages=4 \
      --num_micro_batches=8 --out=/tmp/1f1b.png

Measured: a training step traced by the trainer's `--trace_train_step=N`
(its `LOGDIR/train/run_metadata_step_N.pb`), one row per device:

  .venv/bin/lingvo-ext-timeline --logdir=/tmp/lx/lm_tiny --out=/tmp/step.svg

Each writes the picture (PNG or SVG, by the extension of --out) and a Chrome
trace (--trace_json, default: --out with .trace.json) to open in
https://ui.perfetto.dev. See docs/schedules.md.
"""

import argparse
import os
import re
import sys

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-bad-import-order
from lingvo_ext.pipeline import kinds
from lingvo_ext.pipeline import records
from lingvo_ext.tracing import step_trace
from lingvo_ext.tracing import timeline


def _Parser():
  parser = argparse.ArgumentParser(
      prog='.venv/bin/lingvo-ext-timeline',
      description=__doc__.split('\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='Schedules: %s. Details: docs/schedules.md.' %
      ', '.join(sorted(records.ACTION_SCHEDULES)))
  parser.add_argument('--schedule', help='The schedule to plan, e.g. 1f1b.')
  parser.add_argument('--num_stages', type=int, default=4,
                      help='Pipeline cells, K.')
  parser.add_argument('--num_micro_batches', type=int, default=8,
                      help='Micro-batches, M.')
  parser.add_argument('--devices', type=int, default=0,
                      help='Devices the cells run on (default: one per cell).')
  parser.add_argument('--recompute', action='store_true',
                      help='Recompute each forward pass before its backward.')
  parser.add_argument('--logdir',
                      help='Draw the step a trainer traced in this logdir.')
  parser.add_argument('--step', type=int, default=0,
                      help='The traced step (default: the last one traced).')
  parser.add_argument('--out', required=True,
                      help='The picture to write: a .png or .svg file.')
  parser.add_argument('--trace_json',
                      help='The Chrome trace (default: --out, .trace.json).')
  return parser


def _Fail(message: str) -> int:
  print('error: ' + message, file=sys.stderr)
  return 2


def main(argv=None) -> int:
  args = _Parser().parse_args(argv)
  if bool(args.schedule) == bool(args.logdir):
    return _Fail('pass --schedule=NAME (a planned timeline) or --logdir=DIR '
                 '(a traced step), not both or neither.')
  if not re.search(r'\.(png|svg)$', args.out):
    return _Fail(f'--out={args.out} must end in .png or .svg.')
  out_dir = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(out_dir):
    return _Fail(f'--out={args.out}: the directory {out_dir} does not exist; '
                 'create it first.')
  trace_json = args.trace_json or re.sub(r'\.(png|svg)$', '.trace.json',
                                         args.out)
  if args.schedule:
    if args.schedule not in records.ACTION_SCHEDULES:
      return _Fail(f'--schedule={args.schedule} has no action list; use one '
                   f'of {", ".join(sorted(records.ACTION_SCHEDULES))}.')
    try:
      spec = kinds.StageSpec(
          num_stages=args.num_stages, num_devices=args.devices or
          args.num_stages, num_micro_batches=args.num_micro_batches,
          recompute=args.recompute)
      records.Build(args.schedule, spec)
    except ValueError as e:
      return _Fail(str(e))
    idle = timeline.DrawPlanned(args.schedule, spec, args.out)
    step_trace.WriteJson(timeline.PlannedChromeTrace(args.schedule, spec),
                         trace_json)
  else:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    try:
      path = timeline.TracePath(args.logdir, args.step)
      with open(path, 'rb') as f:
        metadata = tf.compat.v1.RunMetadata.FromString(f.read())
    except ValueError as e:
      return _Fail(str(e))
    except OSError as e:
      return _Fail(f'--logdir={args.logdir}: cannot read {e.filename} '
                   f'({e.strerror}); pass the step --trace_train_step traced.')
    idle = timeline.DrawMeasured(metadata, args.out, trace_json,
                        title=os.path.basename(path))
  print(f'wrote {args.out} (idle {100 * idle:.1f}%) and {trace_json}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
