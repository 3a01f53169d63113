"""Stacked variables: same numbers, smaller graph, per-layer checkpoints."""

import os
import re
import subprocess
import sys

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
from lingvo.core import saver as lingvo_saver
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.core import stacking
from tests.support import ROOT
from tests.support import gpipe_testlib
from tests.support import zygote

sys.path.insert(0, ROOT)
from params import lm  # pylint: disable=g-import-not-at-top,g-bad-import-order


def _TaskParams(stack, num_partitions=1, num_layers=2):
  exp = lm.TransformerLmTiny()
  p = exp.Task()
  p.input = exp.Train()
  p.num_layers = num_layers
  p.num_partitions = num_partitions
  p.num_micro_batches = 2 if num_partitions > 1 else 1
  p.stack_variables = stack
  return p


def _Build(p, num_devices=1):
  """(graph, task) with the train op built."""
  g = tf.Graph()
  with g.as_default(), gpipe_testlib.Cluster(num_devices):
    tf.random.set_seed(1234)
    task = p.Instantiate()
    task.FPropDefaultTheta()
    task.BProp()
  return g, task


def _Train(p, steps, num_devices=1):
  """Losses of `steps` Adam steps, {checkpoint name: value} after, task."""
  g, task = _Build(p, num_devices)
  with g.as_default():
    init = tf.global_variables_initializer()
    variables = tf.global_variables()
    values = [v.read_value() for v in variables]
  with gpipe_testlib.Session(g, num_devices) as sess:
    sess.run(init)
    losses = [sess.run([task.loss, task.train_op])[0] for _ in range(steps)]
    final = sess.run(values)
  return losses, {v.name: x for v, x in zip(variables, final)}, task


def _AssertSameWeights(a, b, atol=1e-6):
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_allclose(a[name], b[name], atol=atol, rtol=0,
                               err_msg=name)


@pytest.mark.parametrize('num_partitions', [
    pytest.param(1, marks=pytest.mark.slow), 2])
def testStackedEqualsUnstackedAfterThreeAdamSteps(num_partitions):
  k = num_partitions
  loss_a, weights_a, _ = _Train(_TaskParams(False, k), 3, num_devices=k)
  loss_b, weights_b, task = _Train(_TaskParams(True, k), 3, num_devices=k)
  np.testing.assert_allclose(loss_a, loss_b, atol=1e-6, rtol=0)
  assert loss_a[-1] < loss_a[0]
  # Every checkpoint name, Adam's m and v included, with the same value.
  assert any(n.endswith('/var/Adam:0') for n in weights_b)
  _AssertSameWeights(weights_a, weights_b)
  # Each cell (device) stacks its own layers' variables.
  keys = [k for k in task.pipeline.vars if '_stacked_' in k]
  assert {key.split('_')[0] for key in keys} == {'d%d' % i for i in range(k)}
  graph = task.pipeline.vars[keys[0]].graph
  assert len(stacking.StackedVariables(graph)) == len(keys)
  for key in keys:
    cell = task.pipeline.params.cell_tpl[int(key[1])]
    layers = {s.name for s in cell.sub}
    for name in stacking.MasterNames(task.pipeline.vars[key]):
      assert name.split('/')[1] in layers, (key, name)


def _Counts(p):
  g, task = _Build(p)
  ops = g.get_operations()
  return dict(
      variables=sum(op.type == 'VarHandleOp' for op in ops),
      trainable=len(task.vars.Flatten()),
      ops=len(ops),
      updates=sum(op.type == 'ResourceApplyAdam' for op in ops),
      checkpoint_names=sorted(v.name for v in g.get_collection(
          tf.GraphKeys.GLOBAL_VARIABLES)))


@pytest.mark.slow  # Two 24-layer graphs; the quick tier builds smaller ones.
def testGraphIsSmallerFor24Layers():
  plain = _Counts(_TaskParams(False, num_layers=24))
  stacked = _Counts(_TaskParams(True, num_layers=24))
  print('unstacked', {k: v for k, v in plain.items() if k[0] != 'c'})
  print('stacked', {k: v for k, v in stacked.items() if k[0] != 'c'})
  # 12 variables per Transformer layer and 6 in the embedding and softmax;
  # stacked, one per shape in the cell.
  assert plain['trainable'] == 24 * 12 + 6
  assert stacked['trainable'] <= 12
  # One ResourceApplyAdam per variable, but for the embedding table, whose
  # gradient is sparse (Adam updates it with scatter ops).
  assert plain['updates'] == plain['trainable'] - 1
  assert stacked['updates'] == stacked['trainable'] - 1
  # Variables: each trainable one, Adam's two slots, and a few others.
  assert plain['variables'] == 3 * plain['trainable'] + 3
  assert stacked['variables'] == 3 * stacked['trainable'] + 3
  assert stacked['ops'] * 2 < plain['ops']
  # The checkpoint names are the same.
  assert stacked['checkpoint_names'] == plain['checkpoint_names']


def _SaveAndRead(p, path, num_devices, use_lingvo_saver, steps=1):
  """Trains `steps`, saves to `path`; returns {name: value} saved."""
  os.makedirs(path)
  g, task = _Build(p, num_devices)
  with g.as_default():
    init = tf.global_variables_initializer()
    variables = tf.global_variables()
    if use_lingvo_saver:
      saver = lingvo_saver.Saver(path, variables=variables)
    else:
      saver = tf.train.Saver(sharded=True)
  with gpipe_testlib.Session(g, num_devices, optimize=False) as sess:
    sess.run(init)
    for _ in range(steps):
      sess.run(task.train_op)
    if use_lingvo_saver:
      _, prefix = saver.Save(sess)
    else:
      prefix = saver.save(sess, os.path.join(path, 'ckpt'), global_step=steps)
  reader = tf.train.load_checkpoint(prefix)
  return prefix, {
      n: reader.get_tensor(n)
      for n in reader.get_variable_to_shape_map()
  }


def _RestoreAndRead(p, prefix, num_devices, use_lingvo_saver):
  g, _ = _Build(p, num_devices)
  with g.as_default():
    variables = tf.global_variables()
    if use_lingvo_saver:
      saver = lingvo_saver.Saver(os.path.dirname(prefix), variables=variables)
    else:
      saver = tf.train.Saver(sharded=True)
    uninitialized = tf.report_uninitialized_variables()
    values = [v.read_value() for v in variables]
  with gpipe_testlib.Session(g, num_devices, optimize=False) as sess:
    if use_lingvo_saver:
      saver.Restore(sess, path=prefix)
    else:
      saver.restore(sess, prefix)
    assert not sess.run(uninitialized).size
    got = sess.run(values)
  return {v.name[:-2]: x for v, x in zip(variables, got)}


# Builds the registered lm task four times, training and saving it twice and
# restoring it twice: end-to-end by pytest.ini's definition (the whole suite
# runs it, and CI's numerics pass).
@pytest.mark.e2e
def testCheckpointRoundTripsBothWays(tmp_path):
  # Unstacked at K=2 (two devices) into stacked at K=1, with Lingvo's saver
  # (the trainer's).
  prefix, saved = _SaveAndRead(
      _TaskParams(False, 2), str(tmp_path / 'a'), 2, use_lingvo_saver=True)
  assert any(n.endswith('/var/Adam_1') for n in saved)
  restored = _RestoreAndRead(_TaskParams(True, 1), prefix, 1, True)
  _AssertSameWeights(saved, restored, atol=0)
  # Stacked at K=1 into unstacked at K=2 under the same names, with
  # tf.train.Saver (the views are SaveableObjects).
  prefix, saved_stacked = _SaveAndRead(
      _TaskParams(True, 1), str(tmp_path / 'b'), 1, use_lingvo_saver=False,
      steps=2)
  assert sorted(saved_stacked) == sorted(saved)
  restored = _RestoreAndRead(_TaskParams(False, 2), prefix, 2, False)
  _AssertSameWeights(saved_stacked, restored, atol=0)


def _Fcs(n, dim=4):
  return [gpipe_testlib.Fc('fc%d' % i, dim, dim, seed=i) for i in range(n)]


def testMaxCombinedVariableSizeSplitsGroups():
  # Six [4, 4] float weights (64 bytes each) under a 130-byte cap: 3 stacks
  # of 2; the six [4] biases (16 bytes) fit in one.
  def Inputs():
    return (tf.constant(np.random.RandomState(0).rand(4, 4), tf.float32),)

  cells = [gpipe.FeatureExtractionLayer.Params().Set(name='c0', sub=_Fcs(6))]
  plain = gpipe_testlib.RunPipelineAndSequential(cells, 1, Inputs)
  stacked = gpipe_testlib.RunPipelineAndSequential(
      cells, 1, Inputs, stack_variables=True, max_combined_variable_size=130)
  gpipe_testlib.AssertAllClose(plain[0], stacked[0], atol=1e-6)
  shapes = sorted(tuple(g.shape) for g in stacked[2])
  assert shapes == [(2, 4, 4)] * 3 + [(6, 4)], shapes
  with pytest.raises(ValueError, match='max_combined_variable_size'):
    stacking.VariableStacker(0)


def testRewritingSlotsTwiceIsAnError():
  g, _ = _Build(_TaskParams(True))
  with g.as_default():
    with pytest.raises(ValueError, match='already called'):
      stacking.StackSlotVariables()


def testNestedStackingIsAnError():
  inner = gpipe.SeqLayer.Params().Set(
      name='inner', stack_variables=True,
      cell_tpl=[gpipe.FeatureExtractionLayer.Params().Set(
          name='c0', sub=_Fcs(2))])
  outer = gpipe.SeqLayer.Params().Set(
      name='outer', stack_variables=True,
      cell_tpl=[gpipe.FeatureExtractionLayer.Params().Set(
          name='c1', sub=[inner])])
  with tf.Graph().as_default(), cluster_factory.ForTestingWorker(cpus=1):
    with pytest.raises(ValueError, match='already being stacked'):
      outer.Instantiate()


def testLearnerVariableFilterIsAnError():
  p = _TaskParams(True)
  p.train.bprop_variable_filter = 'layer_000'
  with tf.Graph().as_default(), gpipe_testlib.Cluster(1):
    py_utils.GetOrCreateGlobalStepVar()
    with pytest.raises(ValueError, match='stack_variables'):
      p.Instantiate()


def _Trainer(*flags):
  # --alsologtostderr: Lingvo's full log (Restored, Place variable) in stdout.
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', '--alsologtostderr',
       *flags], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-5000:]
  return proc.stdout


def _Names(logdir, step):
  path = os.path.join(logdir, 'train', 'ckpt-%08d' % step)
  return sorted(tf.train.load_checkpoint(path).get_variable_to_shape_map())


@pytest.mark.e2e
def testTrainerResumesAcrossStacking(tmp_path, tiny_gpipe_run):
  # Unstacked, 2 cells on 2 devices, 3 steps: a copy of the shared run.
  assert tiny_gpipe_run.model == 'lm.TransformerLmTinyGPipe'
  assert '--worker_split_size=2' in tiny_gpipe_run.flags
  logdir = tiny_gpipe_run.Copy(str(tmp_path / 'log'))
  stack = '--model_params_override=task.stack_variables:True'
  # Stacked, 1 cell: restores it, saves under the same names.
  out = _Trainer('--model=lm.TransformerLmTiny', f'--logdir={logdir}',
                 '--max_steps=4', stack)
  assert 'Restored 3 ' in out
  assert re.search(r'Place variable lm/pipeline/d0_stacked_\d+/var', out)
  assert _Names(logdir, 4) == _Names(logdir, 3)
  # Unstacked again (K=1), from the stacked run's checkpoint.
  out = _Trainer('--model=lm.TransformerLmTiny', f'--logdir={logdir}',
                 '--max_steps=5')
  assert 'Restored 4 ' in out
  assert not re.search(r'Place variable \S*_stacked_', out)
  assert _Names(logdir, 5) == _Names(logdir, 3)
