"""Schedules: the registry, and what '1f1b' keeps alive, read from the graph.

The activation count is read from the dataflow and control edges of the
graph, which TensorFlow's executor must obey whatever the timing: micro-batch
t's activations of cell i (forward or recomputed) are dead before micro-batch
t' is computed there only if every op reading them (the backward ops, the
batched weight gradient) is an ancestor of t''s gates. The largest set of
micro-batches not so ordered is how many can be alive at once. 'unrolled'
with recompute, and '1f1b' with its control edges removed, are measured the
same way and have M: the count is not bounded by construction of the test.
"""

import re
import subprocess
import sys

import lingvo.compat as tf
from lingvo.core import py_utils
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import records
from lingvo_ext.pipeline import schedules
from tests.core import test_gpipe
from tests.support import ROOT
from tests.support import gpipe_testlib as lib

B, D = 16, 6


def test_one_face_lists_without_tensorflow_schedules_on_first_use():
  # The lists half imports no TensorFlow; SCHEDULES comes on first use, once.
  code = (
      'import sys\n'
      'from lingvo_ext.pipeline import schedules as s\n'
      'spec = s.StageSpec(num_stages=2, num_devices=2, num_micro_batches=2)\n'
      'assert s.Build("1f1b", spec) and s.ParseLists(s.FormatLists(\n'
      '    s.Build("1f1b", spec))) == s.Build("1f1b", spec)\n'
      'assert "tensorflow" not in sys.modules\n'
      'from lingvo_ext.pipeline.schedules import SCHEDULES\n'
      'assert SCHEDULES is s.SCHEDULES\n'
      'assert s.SCHEDULES["recurrent"] is s.Recurrent\n'
      'assert s.SCHEDULES["zbv"].__name__ == "zbv"\n'
      'assert {"SCHEDULES", "Interpreter"} <= set(dir(s))\n'
      'try:\n'
      '  s.NoSuchName\n'
      '  sys.exit(3)\n'
      'except AttributeError:\n'
      '  pass\n'
      'print("ok")\n')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.endswith('ok\n'), out.stdout


def test_every_schedule_is_one_registry_entry():
  assert set(schedules.SCHEDULES) == {'unrolled', '1f1b', 'recurrent',
                                      'interleaved_1f1b', 'zero_bubble', 'zbv'}
  # One validator of names, the records': every table derives from them.
  assert tuple(schedules.SCHEDULES) == records.NAMES
  records.CheckName('zbv', 'pipe')
  with pytest.raises(ValueError) as e:
    records.CheckName('x', 't', 'task.schedule', 'task.schedule')
  assert str(e.value) == (
      "t: task.schedule='x'; use one of %s, e.g. "
      "--model_params_override='task.schedule:\"1f1b\"'." %
      sorted(schedules.SCHEDULES))
  with tf.Graph().as_default(), lib.Cluster(2):
    with pytest.raises(ValueError, match="schedule='gpipe'.*1f1b"):
      gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=test_gpipe._FcCells(2),  # pylint: disable=protected-access
          schedule='gpipe').Instantiate()


def _BackwardGraph(num_cells, num_micro, schedule, recompute, loss_fn=None,
                   functions=False, devices=None, batch=B):
  """The graph and gradient ops; the default loss is nonlinear (recomputes).

  Inline cells unless `functions`: the liveness measure below reads each
  (cell, micro-batch)'s own ops.
  """
  loss_fn = loss_fn or (lambda out: tf.reduce_sum(out * out))
  g = tf.Graph()
  with g.as_default(), lib.Cluster(devices or num_cells):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=test_gpipe._FcCells(num_cells, 3),  # pylint: disable=protected-access
        num_micro_batches=num_micro, schedule=schedule,
        recompute=recompute, cell_functions=functions).Instantiate()
    out = net.FPropDefaultTheta(test_gpipe._Input(batch, D))  # pylint: disable=protected-access
    grads = tf.gradients(loss_fn(out), net.vars.Flatten())
  return g, [t.op for t in grads]


def _Ancestors(op, memo):
  """All ops `op` waits for, through data and control edges."""
  if op in memo:
    return memo[op]
  seen, stack = set(), [op]
  while stack:
    o = stack.pop()
    for parent in [t.op for t in o.inputs] + list(o.control_inputs):
      if parent not in seen:
        seen.add(parent)
        stack.append(parent)
  memo[op] = seen
  return seen


def MaxLiveMicroBatches(graph, fetches, cell, num_micro, recomputed=True,
                        ignore=None):
  """Most micro-batches whose activations of `cell` coexist.

  Args:
    graph: The graph.
    fetches: The gradient ops; only ops they need run (TF prunes the rest).
    cell: The cell.
    num_micro: M.
    recomputed: Count the activations recomputed in the backward pass
      (behind 'recompute_gate's); else those of the forward pass itself
      (behind each micro-batch's 'fwd_gate').
    ignore: A regex: readers whose name matches do not keep activations alive.

  Returns:
    The count.
  """
  memo = {}
  needed = set(fetches).union(*[_Ancestors(f, memo) for f in fetches])
  acts = {t: [] for t in range(num_micro)}
  gates = {t: [] for t in range(num_micro)}
  if recomputed:
    pattern = r'/cell%d_mb(\d+)/(recompute/|recompute_gate)' % cell
  else:
    pattern = r'^()cell%d_mb(\d+)/(fwd_gate$)?' % cell
  for op in graph.get_operations():
    m = re.search(pattern, op.name)
    if not m or re.search(r'_mb\d+/gradients/', op.name):
      continue  # Not an activation (a gradient op names its op).
    if not recomputed:
      t, gate = int(m.group(2)), m.group(3)
    else:
      t, gate = int(m.group(1)), m.group(2) == 'recompute_gate'
    if gate:
      gates[t].append(op)
    elif (op.outputs and op.outputs[0].dtype.is_floating and
          op.type != 'Identity'):
      acts[t].append(op)
  # Activations are computed behind the gate; the layers' per-call Identity
  # of a weight is not one.
  acts = {
      t: [op for op in ops if _Ancestors(op, memo) & set(gates[t])]
      for t, ops in acts.items()
  }
  assert all(gates.values()) and all(acts.values())
  # Ops that read micro-batch t's activations: they must all have run before
  # the activations can be freed. An Identity's output is its input's buffer:
  # its readers count too (layers read their inputs through one).
  def _Readers(ops):
    found = set()
    stack = [c for op in ops for out in op.outputs for c in out.consumers()]
    while stack:
      c = stack.pop()
      if c in found or c not in needed or (ignore and
                                           re.search(ignore, c.name)):
        continue
      found.add(c)
      if c.type == 'Identity':
        stack += [r for out in c.outputs for r in out.consumers()]
    return found

  readers = {t: _Readers(ops) for t, ops in acts.items()}
  most = 0
  for t2 in range(num_micro):
    before = set.intersection(*[_Ancestors(g, memo) for g in gates[t2]])
    alive = 1 + sum(1 for t in range(t2) if not readers[t] <= before)
    most = max(most, alive)
  return most


def _HasRecomputation(graph):
  return any('recompute' in op.name for op in graph.get_operations())


@pytest.mark.parametrize('functions', [False, True])
@pytest.mark.parametrize('num_cells', [
    2, pytest.param(4, marks=pytest.mark.slow)])
def test_1f1b_keeps_at_most_k_micro_batches_alive(num_cells, functions):
  num_micro = 8
  # A per-example loss linear in the outputs: no recomputation, the forward
  # pass itself is held to the 1F1B order.
  g, fetches = _BackwardGraph(num_cells, num_micro, '1f1b', None, lib._Loss,  # pylint: disable=protected-access
                              functions=functions)
  assert not _HasRecomputation(g)
  # Every cell ran its forward pass once per micro-batch: 3 FC layers each
  # (inline), or one call of its function.
  if functions:
    calls = [op for op in g.get_operations()
             if op.type.endswith('PartitionedCall') and
             re.match(r'cell\d_mb\d+/', op.name)]
    assert len(calls) == num_cells * num_micro, [op.name for op in calls]
  else:
    assert sum(op.type == 'Tanh' for op in g.get_operations()) == (
        num_cells * 3 * num_micro)
  # Cell i holds all activations of at most W_i = K - i micro-batches: the
  # 1F1B window ...
  counts = [
      MaxLiveMicroBatches(g, fetches, c, num_micro, recomputed=False,
                          ignore='/weight_grad/')
      for c in range(num_cells)
  ]
  assert counts == [num_cells - c for c in range(num_cells)], counts
  # ... and, for a few more, the weight-matmul inputs (its own, and its
  # outputs as the next cell's) that a run of G = K micro-batches' one
  # weight-gradient MatMul reads: at most G + 2 W_i - 1, whatever M.
  if num_cells == 2:  # Where that bound is below M = 8.
    counts = [
        MaxLiveMicroBatches(g, fetches, c, num_micro, recomputed=False)
        for c in range(num_cells)
    ]
    assert all(n <= num_cells + 2 * (num_cells - c) - 1 < num_micro
               for c, n in enumerate(counts)), counts


def test_1f1b_without_its_control_edges_keeps_all_m(monkeypatch):
  """The measure is not bounded by construction: without the edges, M."""
  num_micro = 8
  monkeypatch.setattr(schedules.Interpreter, '_Wire',  # pylint: disable=protected-access
                      lambda *unused_args: None)
  g, fetches = _BackwardGraph(2, num_micro, '1f1b', None, lib._Loss)  # pylint: disable=protected-access
  assert MaxLiveMicroBatches(
      g, fetches, 0, num_micro, recomputed=False) == num_micro


@pytest.mark.parametrize('functions', [False, True])
@pytest.mark.parametrize('num_cells', [
    2, pytest.param(4, marks=pytest.mark.slow)])
def test_1f1b_recomputes_for_a_nonlinear_loss(num_cells, functions):
  num_micro = 8
  # sum(y^2): dy needs every micro-batch's output, so no backward pass can
  # start before every forward pass ends: 1F1B with recomputation. With
  # cell functions, a (cell, micro-batch) is one call op whose outputs are
  # what it keeps alive.
  g, fetches = _BackwardGraph(num_cells, num_micro, '1f1b', None,
                              functions=functions)
  assert _HasRecomputation(g)
  counts = [
      MaxLiveMicroBatches(g, fetches, c, num_micro) for c in range(num_cells)
  ]
  # Every forward pass first, then each device alternates one recomputed
  # forward and one backward pass in its list's order: one micro-batch's
  # recomputed activations alive at a time in every cell (within 1F1B's
  # window of K - i).
  assert counts == [1] * num_cells, counts
  # 'unrolled' recomputes one micro-batch at a time too.
  g, fetches = _BackwardGraph(num_cells, num_micro, 'unrolled', True)
  assert MaxLiveMicroBatches(g, fetches, 0, num_micro) == 1


def _FcRun(batch, m):
  """The weight-gradient run of 2 cells of 3 FC D x D over m micro-batches.

  Each micro-batch's MatMul operands are rows x (D + D) per layer against
  D x D weights. A run of r micro-batches' weight gradients keeps r - 1 more
  micro-batches' operands: as many as stay within one copy of the weights.
  """
  weights, operands = 2 * 3 * D * D, 2 * 3 * (batch // m) * 2 * D
  return min(m, 1 + weights // operands)


@pytest.mark.parametrize('batch', [
    pytest.param(4, marks=pytest.mark.slow), 8,
    pytest.param(64, marks=pytest.mark.slow)])
def test_unrolled_recomputes_with_weight_gradients_in_runs(batch):
  # 2 cells of 3 FC D x D, M = 4, the runs of _FcRun.
  m = 4
  run = _FcRun(batch, m)
  assert run == {4: 4, 8: 2, 64: 1}[batch]
  g, fetches = _BackwardGraph(2, m, 'unrolled', True, functions=True,
                              batch=batch)
  assert _HasRecomputation(g)
  spec = schedules.StageSpec(2, 2, m, True, weight_gradient_run=run)
  built = _WeightGradientScopes(g)
  assert built == _ListedWeightGradientScopes(schedules.Build('unrolled', spec))
  assert len(built) == 2 * -(-m // run), sorted(built)
  # A run's micro-batches' recomputations are alive together, no more.
  for cell in range(2):
    assert MaxLiveMicroBatches(g, fetches, cell, m) == run
  # And the runs give the sequential model's outputs and gradients.
  results, seq, names = lib.RunVariants(
      test_gpipe._FcCells(2, 3), 2, lambda: [test_gpipe._Input(batch, D)],  # pylint: disable=protected-access
      variants=[('unrolled', True)], num_micro_batches=m)
  lib.AssertVariantsMatch(results, seq, names)


@pytest.mark.parametrize('batch', [4, pytest.param(64, marks=pytest.mark.slow)])
def test_1f1b_takes_weight_gradient_runs_longer_than_k(batch):
  # The cells of test_unrolled_recomputes_with_weight_gradients_in_runs, a
  # loss linear in the outputs (no recompute), K = 2, M = 4: where a run of
  # r > K micro-batches' operands stays within one copy of the weights,
  # '1f1b' takes runs of r instead of summing runs of K.
  m = 4
  run = _FcRun(batch, m)
  assert run == {4: 4, 64: 1}[batch]
  g, fetches = _BackwardGraph(2, m, '1f1b', None, lib._Loss, functions=True,  # pylint: disable=protected-access
                              batch=batch)
  assert not _HasRecomputation(g)
  spec = schedules.StageSpec(2, 2, m, weight_gradient_run=run)
  schedule = schedules.Build('1f1b', spec)
  built = _WeightGradientScopes(g)
  assert built == _ListedWeightGradientScopes(schedule)
  assert len(built) == 2 * -(-m // max(2, run)), sorted(built)
  # Each cell keeps its micro-batches' operands until their run, as the
  # lists' simulation says: all M for runs of M, K - i + K - 1 for runs of K.
  tl = schedules.Simulate(spec, schedule)
  for cell in range(2):
    assert MaxLiveMicroBatches(g, fetches, cell, m, recomputed=False) == (
        tl.PeakInFlight(cell)), cell
  results, seq, names = lib.RunVariants(
      test_gpipe._FcCells(2, 3), 2, lambda: [test_gpipe._Input(batch, D)],  # pylint: disable=protected-access
      variants=[('1f1b', None)], num_micro_batches=m)
  lib.AssertVariantsMatch(results, seq, names)


def test_recomputation_without_its_control_edges_keeps_all_m(monkeypatch):
  """The measure is not bounded by construction: without the edges, M."""
  num_micro = 8
  monkeypatch.setattr(schedules.Interpreter, '_Wire',  # pylint: disable=protected-access
                      lambda *unused_args: None)
  for schedule in ('1f1b', 'unrolled'):
    g, fetches = _BackwardGraph(2, num_micro, schedule, True)
    assert MaxLiveMicroBatches(g, fetches, 0, num_micro) == num_micro


def test_1f1b_recompute_false_with_a_nonlinear_loss_is_an_error():
  with pytest.raises(ValueError, match="recompute=False needs output grad"):
    _BackwardGraph(2, 4, '1f1b', False)


@pytest.mark.parametrize('schedule,num_cells', [('zero_bubble', 2),
                                                ('interleaved_1f1b', 4)])
def test_list_schedules_sum_weight_gradients_as_they_go(schedule, num_cells):
  # Each action's weight gradient is added to the running sum as the action
  # completes, and the sum stays a chain of 2-input adds in the graph that
  # runs: Grappler folds a chain of plain adds into one AddN of all M parts,
  # every micro-batch's weight-sized gradient alive until the last.
  m = 8
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=test_gpipe._FcCells(num_cells, 2),  # pylint: disable=protected-access
        num_micro_batches=m, schedule=schedule).Instantiate()
    out = net.FPropDefaultTheta(test_gpipe._Input(B, D))  # pylint: disable=protected-access
    grads = tf.gradients(tf.reduce_sum(out), net.vars.Flatten())
    init = tf.global_variables_initializer()
  with lib.Session(g, 2) as sess:
    sess.run(init)
    meta = tf.RunMetadata()
    sess.run(grads, options=tf.RunOptions(output_partition_graphs=True),
             run_metadata=meta)
  widest = max((len([i for i in n.input if not i.startswith('^')]), n.name)
               for pg in meta.partition_graphs for n in pg.node
               if n.op == 'AddN')
  assert widest[0] <= 2, widest


def _WeightGradientScopes(graph):
  """The '<cell>_mb<t>' or '<cell>_mb<first>-<last>' scopes of the graph's
  weight-gradient MatMuls."""
  return {re.search(r'(cell\d+_mb[\d-]+)/weight_grad/', op.name).group(1)
          for op in graph.get_operations()
          if op.type == 'MatMul' and '/weight_grad/' in op.name}


def _ListedWeightGradientScopes(lists):
  """The scopes the engine gives the lists' 'B's and runs of 'W's."""
  want = {'cell%d_mb%d' % (a.stage, a.micro_batch)
          for acts in lists for a in acts if a.kind == 'B'}
  for run in schedules.WeightGradientRuns(lists):
    first, last = run[0].micro_batch, run[-1].micro_batch
    want.add('cell%d_mb%s' % (run[0].stage, first if first == last else
                              '%d-%d' % (first, last)))
  return want


@pytest.mark.parametrize('schedule,recompute,num_cells', [
    ('unrolled', False, 2), ('unrolled', True, 2), ('1f1b', None, 2),
    ('1f1b', True, 2), ('1f1b', None, 3), ('zero_bubble', None, 2),
    ('zero_bubble', True, 2), ('interleaved_1f1b', None, 4),
    ('interleaved_1f1b', True, 4)])
def test_the_engine_builds_the_lists_weight_gradients(schedule, recompute,
                                                      num_cells):
  # Each run of 'W' actions of a cell (schedules.WeightGradientRuns), and each
  # 'B', is one weight-gradient scope in the graph, and nothing else is.
  m = 4
  devices = 2 if schedule == 'interleaved_1f1b' else num_cells
  g, _ = _BackwardGraph(num_cells, m, schedule, recompute, lib._Loss,  # pylint: disable=protected-access
                        devices=devices)
  built = _WeightGradientScopes(g)
  spec = schedules.StageSpec(num_cells, devices, m, bool(recompute))
  assert built == _ListedWeightGradientScopes(schedules.Build(schedule, spec))
  assert _HasRecomputation(g) == bool(recompute)
  # 'unrolled' batches all M; '1f1b' runs of K; the others one per action.
  per_cell = {'unrolled': 1, '1f1b': -(-m // num_cells)}.get(schedule, m)
  if recompute:
    per_cell = m
  assert len(built) == num_cells * per_cell, sorted(built)
