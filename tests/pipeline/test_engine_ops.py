"""The ops a pipeline runs per (cell, micro-batch): structure counts.

Where XLA does not apply, a step's time on a CPU is bound by how many small
kernels it runs (docs/benchmarks.md, "Ops per (cell, micro-batch)"). These
tests count the ops one traced step runs, per (cell, micro-batch): the
difference between M=4 and M=2 micro-batches over the 2 added micro-batches
of each cell, so the per-step ops (reads, updates) cancel. A count, not a
time: it changes only when the graph does.
"""

import os

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import pytest

from bench import transformer
from lingvo_ext.core import gpipe
from tests.support import ROOT as _REPO
from tests.support import gpipe_testlib
from tests.support import zygote

_K = 2

# Ops run per (cell, micro-batch), forward and backward, at most: what
# these models run now (FC cells below: 'unrolled' 28.5, '1f1b' 29.5; the
# 2-layer Transformer's cells, 'unrolled': 415.5, the reshapes around each
# weight matmul's 2-D GEMM included: flat_weight_matmuls, far cheaper than
# the broadcasting BatchMatMulV2 they replace). A change that adds ops per
# micro-batch (bookkeeping, a cast, an identity) fails here; lower a bound
# when a change removes some.
FC_BOUND = {'unrolled': 28.5, '1f1b': 29.5}
TRANSFORMER_BOUND = 415.5


def _FcOpsRun(schedule: str, num_micro: int):
  """Ops a traced step of 2 FC cells runs (calls excluded)."""
  g = tf.Graph()
  with g.as_default(), gpipe_testlib.Cluster(_K):
    tf.random.set_seed(1)
    py_utils.GetOrCreateGlobalStepVar()
    p = gpipe.PipeliningLayer.Params().Set(
        name='pipe', num_micro_batches=num_micro, schedule=schedule,
        cell_tpl=[gpipe_testlib.Fc('fc%d' % i, 8, 8, seed=i)
                  for i in range(_K)])
    net = p.Instantiate()
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(8, 8).astype(np.float32))
    out = net.FPropDefaultTheta(x)
    variables = net.vars.Flatten()
    # Linear in the outputs: '1f1b' does not recompute.
    loss = tf.reduce_sum(out * rng.randn(8, 8).astype(np.float32))
    grads = tf.gradients(loss, variables)
    train = tf.group([tf.assign_sub(v, 1e-3 * dv) for v, dv in
                      zip(variables, grads)])
    init = tf.global_variables_initializer()
  with gpipe_testlib.Session(g, _K) as sess:
    sess.run(init)
    sess.run(train)
    md = tf.RunMetadata()
    sess.run(train, options=tf.RunOptions(
        trace_level=tf.RunOptions.FULL_TRACE), run_metadata=md)
  return transformer.OpsRun(md.step_stats)


@pytest.mark.parametrize('schedule', sorted(FC_BOUND))
def test_fc_ops_run_per_cell_and_micro_batch(schedule):
  per = (_FcOpsRun(schedule, 4) - _FcOpsRun(schedule, 2)) / (_K * 2)
  assert 0 < per <= FC_BOUND[schedule], per


def _Forked(cmd, **kwargs):
  """transformer.Run's children forked from the tests' pre-imported server
  (as tests/bench/test_bench_transformer.py)."""
  assert cmd[1] == os.path.join(_REPO, 'bench', 'transformer.py'), cmd
  return zygote.run([cmd[0], '-m', 'bench.transformer'] + cmd[2:], cwd=_REPO,
                    **kwargs)


@pytest.mark.e2e
def test_transformer_ops_run_per_cell_and_micro_batch():
  # Lingvo's GPipeTransformerStack, 2 encoder layers, the default schedule.
  records = transformer.Run(['unrolled'], [2], [(_K, 2), (_K, 4)], steps=1,
                            timeout_s=600, runner=_Forked)
  assert all('error' not in r for r in records), records
  runs = {r['M']: r['ops_run'] for r in records}
  per = (runs[4] - runs[2]) / (_K * 2)
  assert 0 < per <= TRANSFORMER_BOUND, per
