"""Stacked vs unstacked variables on a deep Transformer LM, in one run.

Builds the lm.TransformerLmTiny experiment deepened to --num_layers layers
twice in one process, with task.stack_variables False and True, each in its
own graph and session (2 inter-op, 1 intra-op threads), and reports for each:

- build_s: graph construction (task, FProp, BProp with its optimizer);
- ops, variables (VarHandleOps), update_ops (one per trainable variable);
- step_ms: median training step, the two models' steps alternating;
- update_ms, grad_pack_ms: from one traced step, the time in the optimizer's
  update ops (ResourceApply*/AssignSubVariableOp) and in the Pack ops that
  stack the per-layer gradients of stacked variables;
- save_s, restore_s: median checkpoint save and restore with Lingvo's saver
  (what the trainer uses), under the same per-layer names for both models.

  .venv/bin/python bench/stacking.py                     # 48 layers, Adam, JSON lines
  .venv/bin/python bench/stacking.py --markdown          # the same as a table
  .venv/bin/python bench/stacking.py --optimizer=sgd     # the SGD update instead
  .venv/bin/python bench/stacking.py --quick             # 4 layers, a few steps
  .venv/bin/python bench/stacking.py --model=pipeline_fc  # bench/pipeline.py's model

--model=pipeline_fc is bench/pipeline.py's FC model (8 layers 1536 wide,
batch 128, K=2 cells on 2 CPU devices, M=4) with its SGD step (one
assign_sub per variable), stacked vs unstacked: what stacking does to the
AssignSubVariableOp time of the pipeline.

See docs/benchmarks.md for the numbers.
"""

import os
import statistics
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-import-not-at-top,g-bad-import-order

# isort: split
import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
from lingvo.core import optimizer  # pylint: disable=g-import-not-at-top
from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
from lingvo.core import saver as lingvo_saver  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from bench import harness  # pylint: disable=g-import-not-at-top
from bench import pipeline as pipeline_bench  # pylint: disable=g-import-not-at-top
from bench import pipeline_step  # pylint: disable=g-import-not-at-top
from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
from lingvo_ext.core import stacking  # pylint: disable=g-import-not-at-top
from params import lm  # pylint: disable=g-import-not-at-top

py_utils.SetEagerMode(False)

_UPDATE_OPS = ('ResourceApplyAdam', 'ResourceApplyGradientDescent',
               'ResourceApplyMomentum', 'AssignSubVariableOp')


def _TaskParams(args, stack):
  exp = lm.TransformerLmTiny()
  p = exp.Task()
  p.input = exp.Train()
  p.input.seq_len = args.seq_len
  p.input.batch_size = args.batch_size
  p.num_layers = args.num_layers
  p.model_dim = args.model_dim
  p.hidden_dim = 4 * args.model_dim
  p.stack_variables = stack
  if args.optimizer == 'sgd':
    p.train.learner.optimizer = optimizer.SGD.Params()
  return p


def _BuildLm(args, stack):
  """(train op, number of trainable variables) of the LM task."""
  task = _TaskParams(args, stack).Instantiate()
  task.FPropDefaultTheta()
  task.BProp()
  return task.train_op, len(task.vars.Flatten())


def _BuildPipelineFc(args, stack):
  """bench/pipeline.py's lingvo_ext step, optionally stacked."""
  sizes = pipeline_bench.QUICK if args.quick else pipeline_bench.FULL
  width, batch = sizes['width'], sizes['batch']
  cells = pipeline_step.Cells('homogeneous', width, batch, 2)
  py_utils.GetOrCreateGlobalStepVar()
  net = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=4,
      stack_variables=stack).Instantiate()
  x = tf.constant(
      np.random.RandomState(0).randn(batch, width), dtype=tf.float32)
  loss = tf.reduce_sum(tf.square(net.FPropDefaultTheta(x)))
  variables = net.vars.Flatten()
  grads = tf.gradients(loss, variables)
  train = tf.group(*[
      tf.assign_sub(v, pipeline_step.LEARNING_RATE * g)
      for v, g in zip(variables, grads)
  ])
  if stack:
    stacking.StackSlotVariables()  # No slots with SGD; for the checkpoint.
  return train, len(variables)


class _Model:
  """One model in its own graph and session."""

  def __init__(self, args, stack):
    self.stack = stack
    self.graph = tf.Graph()
    num_devices = 2 if args.model == 'pipeline_fc' else 1
    with self.graph.as_default(), cluster_factory.ForTestingWorker(
        mode='sync', job='trainer_client', cpus=num_devices,
        split_size=num_devices):
      tf.random.set_seed(1)
      start = time.time()
      build = _BuildPipelineFc if args.model == 'pipeline_fc' else _BuildLm
      self.train_op, self.trainable = build(args, stack)
      self.build_s = time.time() - start
      ops = self.graph.get_operations()
      self.ops = len(ops)
      self.variables = sum(op.type == 'VarHandleOp' for op in ops)
      self.update_ops = sum(op.type in _UPDATE_OPS for op in ops)
      self.logdir = tempfile.mkdtemp(prefix='stacking_bench_')
      self.saver = lingvo_saver.Saver(
          self.logdir, variables=tf.global_variables())
      init = tf.global_variables_initializer()
    config = tf.config_pb2.ConfigProto(
        device_count={'CPU': num_devices}, inter_op_parallelism_threads=2,
        intra_op_parallelism_threads=1)
    self.sess = tf.Session(graph=self.graph, config=config)
    self.sess.run(init)
    self.step_s = []

  def Step(self):
    start = time.time()
    self.sess.run(self.train_op)
    self.step_s.append(time.time() - start)

  def TracedUpdate(self):
    """(update op ms, gradient Pack ms) of one traced step."""
    run_options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
    meta = tf.RunMetadata()
    self.sess.run(self.train_op, options=run_options, run_metadata=meta)
    update = pack = 0.0
    for dev in meta.step_stats.dev_stats:
      for node in dev.node_stats:
        label = node.timeline_label
        op = label.split(' = ')[1].split('(')[0] if ' = ' in label else ''
        ms = node.all_end_rel_micros / 1e3
        if op in _UPDATE_OPS:
          update += ms
        elif op == 'Pack' and '_unstack' in node.node_name:
          pack += ms
    return update, pack

  def Checkpoint(self, repeats):
    """Median seconds to save, then to restore, a checkpoint."""
    saves, restores = [], []
    for _ in range(repeats):
      start = time.time()
      _, path = self.saver.Save(self.sess)
      saves.append(time.time() - start)
      start = time.time()
      self.saver.Restore(self.sess, path=path)
      restores.append(time.time() - start)
    return statistics.median(saves), statistics.median(restores)


def Run(args):
  models = [_Model(args, False), _Model(args, True)]
  for _ in range(args.warmup):
    for m in models:
      m.Step()
  for m in models:
    m.step_s = []
  for _ in range(args.steps):
    for m in models:  # Alternate, so both see the same machine load.
      m.Step()
  rows = []
  for m in models:
    update_ms, pack_ms = m.TracedUpdate()
    save_s, restore_s = m.Checkpoint(args.checkpoint_repeats)
    if args.model == 'pipeline_fc':
      sizes = pipeline_bench.QUICK if args.quick else pipeline_bench.FULL
      desc = dict(model='pipeline_fc', num_layers=pipeline_step.NUM_LAYERS,
                  model_dim=sizes['width'], optimizer='sgd')
    else:
      desc = dict(model='lm', num_layers=args.num_layers,
                  model_dim=args.model_dim, optimizer=args.optimizer)
    rows.append(dict(
        stacked=m.stack, **desc,
        build_s=round(m.build_s, 2), ops=m.ops, variables=m.variables,
        trainable=m.trainable, update_ops=m.update_ops,
        step_ms=round(1e3 * statistics.median(m.step_s), 1),
        update_ms=round(update_ms, 1), grad_pack_ms=round(pack_ms, 1),
        save_s=round(save_s, 3), restore_s=round(restore_s, 3)))
    m.sess.close()
  return rows


def Markdown(rows):
  keys = list(rows[0])
  return harness.Table(keys, [[r[k] for k in keys] for r in rows])


def main(argv=None):
  parser = harness.Parser(__doc__)
  parser.add_argument('--model', choices=('lm', 'pipeline_fc'), default='lm')
  parser.add_argument('--num_layers', type=int, default=48)
  parser.add_argument('--model_dim', type=int, default=64)
  parser.add_argument('--seq_len', type=int, default=32)
  parser.add_argument('--batch_size', type=int, default=8)
  parser.add_argument('--optimizer', choices=('adam', 'sgd'), default='adam')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--checkpoint_repeats', type=int, default=3)
  parser.add_argument('--quick', action='store_true',
                      help='4 layers, 2 steps: a smoke test.')
  args = parser.parse_args(argv)
  if args.quick:
    args.num_layers, args.steps, args.warmup = 4, 2, 1
    args.checkpoint_repeats = 1
  rows = Run(args)
  harness.Emit(args, rows, Markdown)
  return rows


if __name__ == '__main__':
  main()
