"""Bad GPipe input gets a ValueError that names the parameter and the fix."""

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from tests.support import gpipe_testlib as lib

D = 4


def _Cells(n):
  return [
      gpipe.FeatureExtractionLayer.Params().Set(
          name='cell%d' % i, sub=[lib.Fc('fc%d' % i, D, D, i)])
      for i in range(n)
  ]


def _FProp(x_shape, num_devices=2, placeholder=False, **kwargs):
  with tf.Graph().as_default(), lib.Cluster(num_devices):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=_Cells(2), **kwargs).Instantiate()
    if placeholder:
      x = tf.placeholder(tf.float32, x_shape)
    else:
      x = tf.zeros(x_shape)
    return net.FPropDefaultTheta(x)


def test_batch_not_divisible():
  with pytest.raises(ValueError) as e:
    _FProp([6, D], num_micro_batches=4)
  msg = str(e.value)
  assert 'batch size 6' in msg and 'num_micro_batches=4' in msg
  assert '[1, 2, 3, 6]' in msg  # The values that would work.


def test_more_micro_batches_than_examples_is_not_clamped():
  # Lingvo silently sets num_micro_batches to the batch size here.
  with pytest.raises(ValueError, match='batch size 2 .* num_micro_batches=8'):
    _FProp([2, D], num_micro_batches=8)


def test_micro_batch_size_mismatch():
  with pytest.raises(ValueError, match=r'micro_batch_size=3 \* '
                     r'num_micro_batches=2 != batch size 8'):
    _FProp([8, D], num_micro_batches=2, micro_batch_size=3)


def test_unknown_batch_dimension():
  with pytest.raises(ValueError, match=r'batch dimension \(batch_dim=0\) is '
                     'unknown') as e:
    _FProp([None, D], placeholder=True, num_micro_batches=2)
  # The fix for Lingvo's inputs, by their params.
  assert ("NmtInput with pad_to_max_seq_length=True and equal "
          "bucket_batch_limit") in str(e.value)


def test_more_cells_than_tpu_cores(monkeypatch):
  # On TPU each cell needs its own core; Lingvo fails with a bare assert.
  monkeypatch.setattr(py_utils, 'use_tpu', lambda: True)
  with tf.Graph().as_default(), lib.Cluster(2):
    p = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=_Cells(4))
    with pytest.raises(ValueError, match='4 cells in cell_tpl but the model '
                       'split has 2 TPU cores.*num_partitions=2'):
      p.Instantiate()


def test_more_cells_than_cpu_devices_round_robins():
  # Allowed off TPU: 3 cells on 2 devices equal the sequential model.
  pipe_out, seq_out, pipe_grads, seq_grads, _ = lib.RunPipelineAndSequential(
      _Cells(3), 2, lambda: (tf.constant(
          np.random.RandomState(0).randn(4, D).astype(np.float32)),),
      num_micro_batches=2)
  lib.AssertAllClose(pipe_out, seq_out)
  lib.AssertAllClose(pipe_grads, seq_grads)


@pytest.mark.parametrize('cls', [gpipe.SeqLayer, gpipe.PipeliningLayer])
def test_empty_cell_tpl(cls):
  with tf.Graph().as_default(), lib.Cluster(2):
    with pytest.raises(ValueError, match='cell_tpl is empty.*'
                       'PartitionSequentialLayers'):
      cls.Params().Set(name='pipe', cell_tpl=[]).Instantiate()


def test_unknown_schedule():
  with tf.Graph().as_default(), lib.Cluster(2):
    with pytest.raises(ValueError, match="schedule='gpipe'; use one of "
                       r"\['1f1b', 'interleaved_1f1b', 'recurrent', 'unrolled', "
                       r"'zbv', 'zero_bubble'\]"):
      gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=_Cells(2), schedule='gpipe').Instantiate()


def test_valid_config_still_builds():
  out = _FProp([8, D], num_micro_batches=4)
  assert out.shape.as_list() == [8, D]
  assert np.prod(out.shape.as_list()) == 8 * D
