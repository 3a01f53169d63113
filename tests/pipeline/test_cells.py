"""FeatureExtractionLayer (lingvo_ext/pipeline/cells.py): activations fetched and
passed through a pipeline, shapes threaded through FPropMeta, bad params."""

import lingvo.compat as tf
from lingvo.core import layers
import numpy as np
import pytest

from lingvo_ext.pipeline import cells
from tests.core import test_gpipe
from tests.support import gpipe_testlib as lib

B, D = test_gpipe.B, test_gpipe.D


def test_act_fetch_layers():
  # Cell 0 fetches the activation after its first FC layer; cell 1 passes it
  # through, so the pipeline returns (final output, fetched activation).
  fetch = layers.FetchLayer.Params().Set(name='fetch')
  cell0 = cells.FeatureExtractionLayer.Params().Set(
      name='cell0', sub=[lib.Fc('fc0', D, D, 1), fetch, lib.Fc('fc1', D, D, 2)],
      act_fetch_layers=['fetch'], num_act_outputs=1)
  cell1 = cells.FeatureExtractionLayer.Params().Set(
      name='cell1', sub=[lib.Fc('fc2', D, D, 3)], num_act_inputs=1,
      num_act_outputs=1)
  results, seq, names = lib.RunVariants(
      [cell0, cell1], 2, lambda: (test_gpipe._Input(B, D),),  # pylint: disable=protected-access
      num_micro_batches=2)
  lib.AssertVariantsMatch(results, seq, names)
  for out, _ in results.values():
    assert len(out) == 2
    # The fetched activation is tanh(x W0 + b0), not the final output.
    assert not np.allclose(out[0], out[1])


def test_feature_extraction_meta_threads_shapes():
  p = test_gpipe._FcCells(1, layers_per_cell=3)[0]  # pylint: disable=protected-access
  meta = p.cls.FPropMeta(p, lib.Shape(B, D))
  one = layers.FCLayer.FPropMeta(p.sub[0], lib.Shape(B, D)).flops
  assert meta.flops == pytest.approx(3 * one)
  assert [s.ToTensorShape().as_list() for s in meta.out_shapes] == [[B, D]]


def test_act_outputs_mismatch():
  with tf.Graph().as_default():
    p = cells.FeatureExtractionLayer.Params().Set(
        name='f', sub=[lib.Fc('fc', D, D, 0)], act_fetch_layers=['fc'])
    with pytest.raises(ValueError, match='num_act_outputs=0 must equal '
                       r'num_act_inputs \(0\) \+ len\(act_fetch_layers\) '
                       r'\(1\); set num_act_outputs=1'):
      p.Instantiate()
