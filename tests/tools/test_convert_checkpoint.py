"""`python -m lingvo_ext.tools.convert_checkpoint` between namings and K."""

import os
import sys

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.tools import convert_checkpoint as cc
from tests.support import ROOT
from tests.support import lm_loss_testlib as lm_loss_lib
from tests.support import zygote

MODEL = 'lm.TransformerLmTinyGPipe'  # K=2.
# Lingvo's names: cell scopes and leaves named cell_NNN.
LINGVO_NAMES = ('task.partition_independent_names:False;'
                'task.keep_layer_names:False')
STEP = 7


def _Build(override):
  """The model's train graph plus the loss of one fixed batch."""
  mp = cc.ModelParams(MODEL, override)
  g = tf.Graph()
  with g.as_default(), cluster_factory.Cluster(mp.cluster):
    task, loss = lm_loss_lib.BuildWithLoss(mp)
    gs = py_utils.GetGlobalStep()
    ops = py_utils.NestedMap(
        g=g, loss=loss, train=task.train_op, gs=gs,
        set_gs=tf.assign(gs, STEP), init=tf.global_variables_initializer(),
        saver=tf.train.Saver(),
        names=sorted(v.op.name for v in tf.global_variables()))
  return ops


@pytest.fixture(scope='module')
def lingvo_k2(shared_once):
  """A K=2, Lingvo-named checkpoint after one Adam step; (path, loss).

  Built once for all test workers (conftest.py).
  """
  def Build(folder):
    os.makedirs(folder)
    path = os.path.join(folder, 'ckpt-7')
    m = _Build(LINGVO_NAMES)
    assert 'lm/d1/cell_003/logits/w/var/Adam' in m.names, m.names
    with tf.Session(graph=m.g) as sess:
      sess.run(m.init)
      sess.run(m.train)
      sess.run(m.set_gs)
      m.saver.save(sess, path)
      return [path, float(sess.run(m.loss))]

  return tuple(shared_once('convert_checkpoint_lingvo_k2', Build))


def _RestoredLoss(override, path):
  m = _Build(override)
  with tf.Session(graph=m.g) as sess:
    m.saver.restore(sess, path)  # Strict: every variable must be there.
    slot = [v for v in m.g.get_collection('variables')
            if v.op.name.endswith('logits/w/var/Adam')][0]
    assert np.abs(sess.run(slot)).max() > 0  # The slot came across.
    return sess.run([m.loss, m.gs]), m.names


@pytest.mark.e2e
def test_k2_lingvo_names_to_k4_kept_layer_names_same_loss(lingvo_k2, tmp_path):
  src, loss_k2 = lingvo_k2
  dst = str(tmp_path / 'k4' / 'ckpt-7')
  # The real entry point.
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.tools.convert_checkpoint',
       f'--from_model={MODEL}', '--from_names=lingvo',
       f'--from_checkpoint={src}', '--to_num_partitions=4',
       '--to_names=lingvo', f'--to_checkpoint={dst}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'renamed) to' in proc.stdout
  assert tf.train.latest_checkpoint(str(tmp_path / 'k4')) == dst
  with open(tmp_path / 'k4' / 'checkpoint') as f:
    assert str(tmp_path) not in f.read()  # Relative: the directory can move.
  # The target keeps the layers' names (task.keep_layer_names, the default).
  (loss, step), names = _RestoredLoss(
      'task.partition_independent_names:False;task.num_partitions:4', dst)
  assert 'lm/d3/softmax/logits/w/var/Adam' in names
  assert step == STEP
  np.testing.assert_allclose(loss, loss_k2, rtol=1e-5)


@pytest.mark.e2e
def test_k2_lingvo_names_to_k1_partition_independent_same_loss(
    lingvo_k2, tmp_path):
  src, loss_k2 = lingvo_k2
  dst = str(tmp_path / 'k1' / 'ckpt-7')
  assert cc.main([
      f'--from_model={MODEL}', f'--from_model_params_override={LINGVO_NAMES}',
      f'--from_checkpoint={src}', '--to_model=lm.TransformerLmTiny',
      f'--to_checkpoint={dst}'
  ]) == 0
  (loss, step), names = _RestoredLoss('task.num_partitions:1', dst)
  assert 'lm/softmax/logits/w/var/Adam' in names
  assert step == STEP
  np.testing.assert_allclose(loss, loss_k2, rtol=1e-5)

  # And back: partition-independent K=1 -> Lingvo-named K=2.
  back = str(tmp_path / 'back' / 'ckpt-7')
  assert cc.main([
      '--from_model=lm.TransformerLmTiny', f'--from_checkpoint={dst}',
      f'--to_model={MODEL}', '--to_names=lingvo',
      '--to_model_params_override=task.keep_layer_names:False',
      f'--to_checkpoint={back}'
  ]) == 0
  reader, original = (tf.train.load_checkpoint(p) for p in (back, src))
  keys = reader.get_variable_to_shape_map()
  assert sorted(keys) == sorted(original.get_variable_to_shape_map())
  for k in keys:
    np.testing.assert_array_equal(reader.get_tensor(k), original.get_tensor(k))


@pytest.mark.e2e
def test_refuses_a_shape_difference(lingvo_k2, tmp_path, capsys):
  src, _ = lingvo_k2
  assert cc.main([
      f'--from_model={MODEL}', '--from_names=lingvo',
      f'--from_checkpoint={src}', '--to_model_params_override='
      'task.hidden_dim:32', f'--to_checkpoint={tmp_path}/x/ckpt'
  ]) == 1
  err = capsys.readouterr().err
  assert 'differ in shape: lm/d0/cell_001/ffn_in/' in err, err
  assert not os.path.exists(tmp_path / 'x')


def test_plan_names_what_has_no_counterpart():
  ckpt = {'global_step': [], 'm/d0/cell_000/w/var': [2, 2],
          'm/d0/cell_000/w/var/Adam': [2, 2], 'm/d0/extra/var': [1]}
  renames = {'m/d0/cell_000/': 'm/cell_000/'}
  target = {'global_step': [], 'm/cell_000/w/var': [2, 2],
            'm/cell_000/w/var/Adam': [2, 2], 'm/cell_001/w/var': [2, 2]}
  with pytest.raises(cc.ConversionError) as e:
    cc.Plan(ckpt, renames, target, {})
  assert ('1 checkpoint variable(s) have no counterpart in the target '
          'model: m/d0/extra/var') in str(e.value)
  assert ('1 target variable(s) have no counterpart in the checkpoint: '
          'm/cell_001/w/var') in str(e.value)
  del ckpt['m/d0/extra/var'], target['m/cell_001/w/var']
  assert cc.Plan(ckpt, renames, target, {}) == {
      'global_step': 'global_step',
      'm/d0/cell_000/w/var': 'm/cell_000/w/var',
      'm/d0/cell_000/w/var/Adam': 'm/cell_000/w/var/Adam'}
