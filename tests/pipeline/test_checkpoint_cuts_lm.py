"""Checkpoints across cuts through the trainer: the LM cut as Lingvo's
lingvo.core.gpipe cuts it, its checkpoint trained on in lingvo_ext's exact
cut and back (tests/pipeline/test_checkpoint_cuts.py has the layer-level
cases).
"""

import os
import re
import subprocess
import sys

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe
import numpy as np
import pytest

from lingvo_ext.tasks.lm import model as lm_model
from lingvo_ext.tools import convert_checkpoint as cc
from tests.support import ROOT
from tests.support import lm_loss_testlib as lm_loss_lib
from tests.support import zygote

MODEL = 'lm.TransformerLmTinyGPipe'  # 4 leaves: emb, layer_000/001, softmax.
LINGVO_K = 3


class _LingvoCutLm(lm_model.TransformerLm):
  """The LM with lingvo.core.gpipe's cut into 3 cells and Lingvo's names."""

  def _PipelineParams(self):
    p = super()._PipelineParams()
    stack, shapes = self.LayerStack(self.params)
    p.cell_tpl = lingvo_gpipe.PartitionSequentialLayers(stack, LINGVO_K,
                                                        *shapes)
    p.partition_independent_names = False
    return p


def _LmLoss(override, cls=None, restore=None, save=None):
  """Loss of a fixed batch; the model restored strictly or initialized."""
  mp = cc.ModelParams(MODEL, override)
  if cls:
    mp.task.cls = cls
  g = tf.Graph()
  with g.as_default(), cluster_factory.Cluster(mp.cluster):
    tf.random.set_seed(1)
    _, loss = lm_loss_lib.BuildWithLoss(mp, scope='eval')
    saver = tf.train.Saver()
    with tf.Session(graph=g) as sess:
      if restore:
        saver.restore(sess, restore)
      else:
        sess.run(tf.global_variables_initializer())
      if save:
        saver.save(sess, save)
      return sess.run(loss), sorted(v.op.name for v in tf.global_variables())


def _Train(logdir, max_steps, override):
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={MODEL}',
       f'--logdir={logdir}', f'--max_steps={max_steps}',
       f'--model_params_override={override}'],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-5000:]
  return proc.stdout


@pytest.mark.e2e
def test_trainer_restores_a_lingvo_cut_checkpoint_and_back(tmp_path):
  logdir = str(tmp_path / 'lm')
  os.makedirs(os.path.join(logdir, 'train'))
  frozen = 'task.train.learning_rate:0'  # So the weights stay as restored.
  lingvo_loss, lingvo_names = _LmLoss(
      '', cls=_LingvoCutLm, save=os.path.join(logdir, 'train', 'ckpt-00000000'))
  assert 'lm/d2/cell_003/logits/w/var/Adam' in lingvo_names

  # The experiment's own cut (2 cells, partition-independent, kept names).
  out = _Train(logdir, 1, frozen)
  # Lingvo cuts the 4 leaves [1, 1, 2]; the experiment drops cell scopes.
  assert ('restored 93 variables of ckpt-00000000 across a different cut '
          '(90 renamed): d0/cell_000 -> emb, d1/cell_001 -> layer_000, '
          'd2/cell_002 -> layer_001, ... (4 leaves)\n') in out, out[-3000:]
  loss, names = _LmLoss('', restore=os.path.join(logdir, 'train',
                                                 'ckpt-00000001'))
  assert 'lm/softmax/logits/w/var/Adam' in names
  np.testing.assert_allclose(loss, lingvo_loss, rtol=1e-6)

  # And back to Lingvo's naming at K=3 (lingvo_ext's exact cut).
  lingvo_names_k3 = ('task.keep_layer_names:False;'
                     'task.partition_independent_names:False;'
                     f'task.num_partitions:{LINGVO_K};' + frozen)
  out = _Train(logdir, 2, lingvo_names_k3)
  assert re.search(r'restored \d+ variables of ckpt-00000001 across a '
                   r'different cut', out), out[-3000:]
  loss, names = _LmLoss(lingvo_names_k3, restore=os.path.join(
      logdir, 'train', 'ckpt-00000002'))
  assert any(re.match(r'lm/d\d/cell_003/logits/w/var/Adam$', n)
             for n in names)
  np.testing.assert_allclose(loss, lingvo_loss, rtol=1e-6)


@pytest.mark.e2e
def test_nan_stop_names_the_users_layer(tmp_path):
  # Lingvo's leaf names (cell_NNN); the report still names the layer.
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer',
       '--model=lm.TransformerLmTiny', f'--logdir={tmp_path}',
       '--max_steps=20', '--max_nonfinite_steps=2',
       '--model_params_override=task.train.learning_rate:1e39;'
       'task.keep_layer_names:False'],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=600, check=False)
  assert proc.returncode == 3, proc.stdout[-3000:]
  m = re.search(r'First non-finite: variable lm/(cell_\d{3})/\S+\. Last good '
                r'checkpoint: \S+\. That variable is in layer (\w+) '
                r'\((cell_\d{3})\)\. Lower', proc.stdout)
  assert m, proc.stdout[-3000:]
  assert m.group(1) == m.group(3)
  mp = cc.ModelParams('lm.TransformerLmTiny')
  mp.task.input = mp.input
  stack, _ = lm_model.TransformerLm.LayerStack(mp.task)
  assert m.group(2) == stack[int(m.group(1)[5:])].name
