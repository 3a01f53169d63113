"""Checkpoints across cuts: Lingvo's heuristic cut into lingvo_ext's exact one.

lingvo.core.gpipe.PartitionSequentialLayers cuts generated stacks (equal
and uneven layers, 2-8 cells); its checkpoints restore into lingvo_ext's
exact cut (Lingvo's names, partition-independent names, kept layer names)
through `gpipe.CheckpointVarMap`, through the converter without a model, and
through the trainer, with equal outputs; and back.
"""

import re
import sys

import lingvo.compat as tf
from lingvo.core import builder_layers
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import layers
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import cut_checkpoints
from lingvo_ext.pipeline import cuts
from lingvo_ext.tools import convert_checkpoint as cc
from tests.support import ROOT
from tests.support import zygote

BATCH = 4


def _Stack(seed):
  """A generated stack of FC layers: (params, input dim).

  Even seeds: n equal layers; odd seeds: n layers of random widths (uneven
  FLOPs, so the heuristic and the exact cut disagree more often).
  """
  rng = np.random.RandomState(seed)
  n = rng.randint(6, 17)
  if seed % 2 == 0:
    dims = [8] * (n + 1)
  else:
    dims = list(rng.randint(2, 33, size=n + 1))
  stack = [
      layers.FCLayer.Params().Set(name='fc%d' % i, input_dim=int(dims[i]),
                                  output_dim=int(dims[i + 1]))
      for i in range(n)
  ]
  return stack, int(dims[0])


def _Fc4(name):
  return layers.FCLayer.Params().Set(name=name, input_dim=4, output_dim=4)


def _Copies(stack):
  return [p.Copy() for p in stack]


def _Subs(cells):
  return [[s.name for s in c.sub] for c in cells]


def _Sizes(cells):
  return [len(c.sub) for c in cells]


# Generated (seed, K): every K from 2 to 8 over equal and uneven stacks.
CASES = [(seed, k) for seed in range(12) for k in (2, 3, 4, 5, 6, 7, 8)]


@pytest.mark.parametrize('seed,k', CASES)
def test_lingvo_cut_is_lingvos(seed, k):
  stack, dim = _Stack(seed)
  shape = tshape.Shape([BATCH, dim])
  theirs = lingvo_gpipe.PartitionSequentialLayers(_Copies(stack), k, shape)
  ours = gpipe.PartitionSequentialLayers(_Copies(stack), k, shape,
                                         cut='lingvo')
  assert _Subs(ours) == _Subs(theirs)
  assert [c.name for c in ours] == [c.name for c in theirs]
  for a, b in zip(ours, theirs):
    assert [s.ToText() for s in a.sub] == [s.ToText() for s in b.sub]
  # The exact cut's bottleneck is never worse.
  exact = gpipe.PartitionSequentialLayers(_Copies(stack), k, shape)
  flops = [s.cls.FPropMeta(s, tshape.Shape([BATCH, s.input_dim])).flops
           for s in stack]

  def Bottleneck(sizes):
    out, start = 0, 0
    for n in sizes:
      out = max(out, sum(flops[start:start + n]))
      start += n
    return out

  assert Bottleneck(_Sizes(exact)) <= Bottleneck(_Sizes(theirs))


def test_lingvo_cut_flattens_as_lingvo():
  seq = builder_layers.SequentialLayer.Params().Set(
      name='seq', sub=[_Fc4('a'), _Fc4('b')], repeat=3)
  shape = tshape.Shape([2, 4])
  for params in (seq, [_Fc4('x'), seq.Copy(), _Fc4('y')]):
    for k in (2, 3):
      theirs = lingvo_gpipe.PartitionSequentialLayers(
          params.Copy() if not isinstance(params, list) else
          [p.Copy() for p in params], k, shape)
      ours = gpipe.PartitionSequentialLayers(params, k, shape, cut='lingvo')
      assert _Subs(ours) == _Subs(theirs)
  # Lingvo takes a list's items as they are (a SequentialLayer stays one
  # leaf); the exact cut flattens it.
  listed = [_Fc4('x'), seq.Copy(), _Fc4('y')]
  assert sum(_Sizes(gpipe.PartitionSequentialLayers(
      listed, 2, shape, cut='lingvo'))) == 3
  assert sum(_Sizes(gpipe.PartitionSequentialLayers(listed, 2, shape))) == 8


def test_lingvo_cut_keeps_empty_cells_as_lingvo():
  # One layer holds nearly all FLOPs: Lingvo leaves cells empty.
  stack = [layers.FCLayer.Params().Set(name='big', input_dim=64,
                                       output_dim=1)]
  stack += [layers.FCLayer.Params().Set(name='t%d' % i, input_dim=1,
                                        output_dim=1) for i in range(3)]
  shape = tshape.Shape([2, 64])
  theirs = lingvo_gpipe.PartitionSequentialLayers(_Copies(stack), 4, shape)
  ours = gpipe.PartitionSequentialLayers(_Copies(stack), 4, shape,
                                         cut='lingvo')
  assert _Subs(ours) == _Subs(theirs)
  assert 0 in _Sizes(ours)
  assert 0 not in _Sizes(gpipe.PartitionSequentialLayers(stack, 4, shape))


def test_bad_cut_arguments_are_one_line():
  stack, dim = _Stack(0)
  shape = tshape.Shape([BATCH, dim])
  with pytest.raises(ValueError, match=r"cut='heuristic'; use one of exact"):
    gpipe.PartitionSequentialLayers(stack, 2, shape, cut='heuristic')
  with pytest.raises(ValueError, match=r"cost='params' needs cut='exact'"):
    gpipe.PartitionSequentialLayers(stack, 2, shape, cut='lingvo',
                                    cost='params')


def test_keep_layer_names():
  seq = builder_layers.SequentialLayer.Params().Set(
      name='seq', sub=[_Fc4('blk')], repeat=2)
  stack = [_Fc4('proj'), seq, _Fc4(''), _Fc4('head')]
  shape = tshape.Shape([2, 4])
  cells = gpipe.PartitionSequentialLayers(stack, 2, shape,
                                          keep_layer_names=True)
  assert sum(_Subs(cells), []) == ['proj', 'blk_0', 'blk_1', 'cell_003',
                                   'head']
  leaves = sum((cuts.CellLeaves(c) for c in cells), [])
  assert [g for _, _, g in leaves] == ['cell_%03d' % i for i in range(5)]
  assert [u for _, u, _ in leaves] == ['proj', 'blk', 'blk', 'cell_003',
                                       'head']
  # Lingvo's naming (the default) records the user's names.
  cells = gpipe.PartitionSequentialLayers(stack, 2, shape)
  assert sum(_Subs(cells), []) == ['cell_%03d' % i for i in range(5)]
  assert [cuts.LayerLabel(u, g) for c in cells
          for _, u, g in cuts.CellLeaves(c)] == [
              'proj (cell_000)', 'blk (cell_001)', 'blk (cell_002)',
              'cell_003', 'head (cell_004)']


def _Pipeline(cells, lingvo=False, **kwargs):
  cls = lingvo_gpipe.PipeliningLayer if lingvo else gpipe.PipeliningLayer
  return cls.Params().Set(name='pipe', cell_tpl=cells, num_micro_batches=2,
                          **kwargs)


class _Built:
  """A pipeline in its own graph: outputs of a fixed input, a saver."""

  def __init__(self, pipe_p, x, seed):
    self.graph = tf.Graph()
    with self.graph.as_default(), cluster_factory.ForTestingWorker(
        cpus=1, split_size=1):
      tf.random.set_seed(seed)
      py_utils.GetOrCreateGlobalStepVar()
      self.layer = pipe_p.Instantiate()
      self.y = self.layer.FPropDefaultTheta(tf.constant(x))
      self.init = tf.global_variables_initializer()
      self.names = sorted(v.op.name for v in tf.global_variables())

  def Session(self):
    """A session on the graph, Grappler off.

    What the tests compare is which values land in which variable, every
    graph's outputs computed alike (none optimized, so no fusion can round
    one of them differently); each run here is a new set of fetches, which
    Grappler would optimize anew.
    """
    config = tf.config_pb2.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return tf.Session(graph=self.graph, config=config)

  def Run(self, restore=None, save=None):
    """Initializes or restores (a path: CheckpointVarMap), runs, saves."""
    with self.graph.as_default(), self.Session() as sess:
      if restore:
        var_map = gpipe.CheckpointVarMap(self.layer, restore,
                                         tf.global_variables())
        tf.train.Saver(var_list=var_map).restore(sess, restore)
      else:
        sess.run(self.init)
      y = sess.run(self.y)
      if save:
        tf.train.Saver().save(sess, save)
      return y


def _CutsDiffer(seed, k):
  stack, dim = _Stack(seed)
  shape = tshape.Shape([BATCH, dim])
  theirs = _Sizes(lingvo_gpipe.PartitionSequentialLayers(
      _Copies(stack), k, shape))
  ours = _Sizes(gpipe.PartitionSequentialLayers(_Copies(stack), k, shape))
  return theirs != ours and 0 not in theirs


# Stacks whose two cuts differ (the point), Lingvo's with no empty cell (its
# pipeline cannot run one): the first such K of each of 8 stacks. Stacks s
# and s + 4 take the same one of the four namings; the quick tier runs each
# naming once, with the smaller K of its two stacks (the other marked slow).
PIPE_CASES = [
    next((s, k) for k in (2 + (s * 3 + j) % 7 for j in range(7))
         if _CutsDiffer(s, k)) for s in range(8)
]


def _QuickCut(case):
  seed, k = case
  other = (seed + 4) % 8
  return (k, seed) < (PIPE_CASES[other][1], other)


@pytest.mark.parametrize('seed,k', [
    case if _QuickCut(case) else pytest.param(*case, marks=pytest.mark.slow)
    for case in PIPE_CASES])
def test_lingvo_checkpoint_restores_into_exact_cut(seed, k, tmp_path):
  stack, dim = _Stack(seed)
  shape = tshape.Shape([BATCH, dim])
  x = np.random.RandomState(seed).randn(BATCH, dim).astype(np.float32)
  theirs = lingvo_gpipe.PartitionSequentialLayers(_Copies(stack), k, shape)
  assert 0 not in _Sizes(theirs)
  path = str(tmp_path / 'lingvo' / 'ckpt')
  lingvo_model = _Built(_Pipeline(theirs, lingvo=True), x, seed)
  y_lingvo = lingvo_model.Run(save=path)

  # Each stack gets one of the four namings (Lingvo's or partition-
  # independent cell scopes; cell_NNN or the layers' names), each twice.
  independent, keep = (seed // 2) % 2 == 1, seed % 2 == 1
  cells = gpipe.PartitionSequentialLayers(_Copies(stack), k, shape,
                                          keep_layer_names=keep)
  ours = _Built(_Pipeline(cells, partition_independent_names=independent),
                x, seed + 1)
  assert _Sizes(cells) != _Sizes(theirs)
  if not independent and not keep:
    # Why the helper is needed: a plain restore fails.
    with pytest.raises(tf.errors.NotFoundError):
      with tf.Session(graph=ours.graph) as sess:
        with ours.graph.as_default():
          tf.train.Saver().restore(sess, path)
  y = ours.Run(restore=path)
  np.testing.assert_array_equal(y, y_lingvo)

  # And back: lingvo_ext's checkpoint into Lingvo's cut.
  back = str(tmp_path / ('ours_%d_%d' % (independent, keep)) / 'ckpt')
  ours.Run(restore=path, save=back)
  if keep:
    # Lingvo's cells do not know the layers' names; cut='lingvo' gives
    # Lingvo's cells recording them.
    back_cells = gpipe.PartitionSequentialLayers(
        _Copies(stack), k, shape, cut='lingvo')
  else:
    back_cells = lingvo_gpipe.PartitionSequentialLayers(
        _Copies(stack), k, shape)
  fresh = _Built(_Pipeline(back_cells, lingvo=True), x, seed + 2)
  np.testing.assert_array_equal(fresh.Run(restore=back), y_lingvo)


def test_the_issue_16_equal_layers_in_4_cells(tmp_path):
  stack = [layers.FCLayer.Params().Set(name='fc%d' % i, input_dim=8,
                                       output_dim=8) for i in range(16)]
  shape = tshape.Shape([BATCH, 8])
  theirs = lingvo_gpipe.PartitionSequentialLayers(_Copies(stack), 4, shape)
  ours = gpipe.PartitionSequentialLayers(_Copies(stack), 4, shape)
  assert (_Sizes(theirs), _Sizes(ours)) == ([3, 4, 4, 5], [4, 4, 4, 4])
  x = np.ones([BATCH, 8], np.float32)
  path = str(tmp_path / 'ckpt')
  y = _Built(_Pipeline(theirs, lingvo=True), x, 0).Run(save=path)
  built = _Built(_Pipeline(ours), x, 1)
  reader = tf.train.load_checkpoint(path)
  plan = cut_checkpoints.PlanRestore(built.layer, reader.get_variable_to_shape_map(),
                          built.names)
  assert plan.Describe() == ('d1/cell_003 -> d0/cell_003, d2/cell_007 -> '
                             'd1/cell_007, d3/cell_011 -> d2/cell_011')
  assert plan.num_renamed == 6
  np.testing.assert_array_equal(built.Run(restore=path), y)


def _Variables(graph_fn, path):
  with tf.Graph().as_default():
    graph_fn()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      tf.train.Saver().save(sess, path)


def test_missing_and_ambiguous_are_one_line(tmp_path):
  stack, dim = _Stack(0)
  shape = tshape.Shape([BATCH, dim])
  cells = gpipe.PartitionSequentialLayers(_Copies(stack), 2, shape)
  built = _Built(_Pipeline(cells), np.ones([BATCH, dim], np.float32), 0)
  short = str(tmp_path / 'short' / 'ckpt')
  # A checkpoint of the first two layers only.
  _Variables(lambda: [tf.get_variable('d0/cell_%03d/%s/var' % (i, n), s)
                      for i in range(2) for n, s in (('w', [dim, dim]),
                                                     ('b', [dim]))], short)
  with pytest.raises(ValueError) as e:
    gpipe.CheckpointVarMap(built.layer, short)
  message = str(e.value)
  assert '\n' not in message
  assert re.search(r'\d+ variable\(s\) of the model have no counterpart in '
                   r'\S+short/ckpt, under any cut or naming of the layers: '
                   r'd0/cell_002/b/var', message), message
  twice = str(tmp_path / 'twice' / 'ckpt')
  _Variables(lambda: [tf.get_variable('%s/cell_%03d/%s/var' % (d, i, n), s)
                      for d in ('d0', 'd5') for i in range(len(stack))
                      for n, s in (('w', [dim, dim]), ('b', [dim]))], twice)
  with pytest.raises(ValueError, match=r'^Ambiguous restore from \S+: several '
                     r'checkpoint keys map onto one variable: d0/cell_\d+/b/'
                     r'var <- d0/cell_\d+/b/var / d5/cell_\d+/b/var'):
    gpipe.CheckpointVarMap(built.layer, twice)


def test_nan_report_names_the_users_layer():
  stack, dim = _Stack(0)
  shape = tshape.Shape([BATCH, dim])
  for keep, independent, var in ((False, False, 'd0/cell_002/w/var'),
                                 (True, True, 'fc2/w/var'),
                                 (True, False, 'd0/fc2/w/var')):
    cells = gpipe.PartitionSequentialLayers(_Copies(stack), 2, shape,
                                            keep_layer_names=keep)
    built = _Built(_Pipeline(cells, partition_independent_names=independent),
                   np.ones([BATCH, dim], np.float32), 0)
    assert var in built.names
    text = cuts.NameLayers(cuts.LayerLabels(built.layer),
                           f'variable {var}: NaN')
    assert text == f'variable {var} (layer fc2 (cell_002)): NaN'


@pytest.mark.e2e  # The converter's command line, in a subprocess.
def test_converter_without_a_model(tmp_path):
  stack = [layers.FCLayer.Params().Set(name='fc%d' % i, input_dim=8,
                                       output_dim=8) for i in range(16)]
  shape = tshape.Shape([BATCH, 8])
  x = np.random.RandomState(3).randn(BATCH, 8).astype(np.float32)
  src = str(tmp_path / 'lingvo' / 'ckpt')
  theirs = lingvo_gpipe.PartitionSequentialLayers(_Copies(stack), 4, shape)
  y = _Built(_Pipeline(theirs, lingvo=True), x, 0).Run(save=src)
  # The real entry point: Lingvo's [3, 4, 4, 5] to the exact [4, 4, 4, 4].
  dst = str(tmp_path / 'exact' / 'ckpt')
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.tools.convert_checkpoint',
       f'--from_checkpoint={src}', '--from_cut=3,4,4,5', '--to_cut=4,4,4,4',
       f'--to_checkpoint={dst}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'wrote 33 variables (6 renamed)' in proc.stdout, proc.stdout
  ours = _Built(_Pipeline(gpipe.PartitionSequentialLayers(
      _Copies(stack), 4, shape)), x, 1)
  with ours.Session() as sess, ours.graph.as_default():
    tf.train.Saver().restore(sess, dst)  # Strict: every key as the model's.
    np.testing.assert_array_equal(sess.run(ours.y), y)

  # To partition-independent, kept names; and back to Lingvo's cut.
  names = ','.join('fc%d' % i for i in range(16))
  kept = str(tmp_path / 'kept' / 'ckpt')
  assert cc.main([f'--from_checkpoint={src}', '--from_cut=3,4,4,5',
                  '--to_cut=4,4,4,4', '--to_names=partition_independent',
                  '--to_keep_layer_names', f'--layer_names={names}',
                  f'--to_checkpoint={kept}']) == 0
  ours = _Built(_Pipeline(gpipe.PartitionSequentialLayers(
      _Copies(stack), 4, shape, keep_layer_names=True),
                          partition_independent_names=True), x, 2)
  assert 'fc15/w/var' in ours.names
  with ours.Session() as sess, ours.graph.as_default():
    tf.train.Saver().restore(sess, kept)
    np.testing.assert_array_equal(sess.run(ours.y), y)
  back = str(tmp_path / 'back' / 'ckpt')
  assert cc.main([f'--from_checkpoint={kept}', '--from_cut=4,4,4,4',
                  '--from_names=partition_independent',
                  '--from_keep_layer_names', f'--layer_names={names}',
                  '--to_cut=3,4,4,5', f'--to_checkpoint={back}']) == 0
  a, b = (tf.train.load_checkpoint(p) for p in (back, src))
  assert a.get_variable_to_shape_map() == b.get_variable_to_shape_map()
  for key in b.get_variable_to_shape_map():
    np.testing.assert_array_equal(a.get_tensor(key), b.get_tensor(key))
  # A layout that does not fit the keys is refused.
  assert cc.main([f'--from_checkpoint={src}', '--from_cut=8,8',
                  '--from_names=partition_independent', '--to_cut=4,4,4,4',
                  f'--to_checkpoint={tmp_path}/x/ckpt']) == 1
