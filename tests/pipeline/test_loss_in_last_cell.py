"""GPipeTransformerStack(loss_in_last_cell=True): the loss in the last cell.

The per-example cross-entropy comes out of the pipeline, so a summed loss is
linear in its outputs and '1f1b' runs without recomputing; training equals
the default schedule with Lingvo's loss after the pipeline, and the
sequential model; with label smoothing (Lingvo's UniformLabelSmoother, Lingvo
MT's default) on an encoder-decoder stack too.
"""

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import layers as lingvo_layers
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import layers_with_gpipe
from lingvo_ext.pipeline import records
from tests.support import gpipe_testlib

_T, _B, _D, _VOCAB, _K, _M = 4, 8, 8, 5, 2, 4
_STEPS = 3


def _Params(schedule, loss_in_last_cell, layers=3, splits=_K, micro=_M,
            decoder_layers=0, smoothing=None):
  """smoothing: the UniformLabelSmoother's uncertainty, or None."""
  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
      name='transformer', model_dim=_D, num_encoder_layers=layers,
      num_decoder_layers=decoder_layers, splits=splits,
      num_micro_batches=micro, state_dtype=tf.float32, random_seed=0,
      schedule=schedule, loss_in_last_cell=loss_in_last_cell)
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.source_dim = _D
    tpl.tr_atten_tpl.num_attention_heads = 2
    tpl.tr_fflayer_tpl.hidden_dim = 2 * _D
  if smoothing is not None:
    p.label_smoothing = lingvo_layers.UniformLabelSmoother.Params().Set(
        num_classes=_VOCAB, uncertainty=smoothing)
  p.emb_tpl.token_emb.Set(embedding_dim=_D, vocab_size=_VOCAB)
  p.emb_tpl.position_emb.embedding_dim = _D
  p.softmax_tpl.Set(input_dim=_D, num_classes=_VOCAB)
  return p


def Build(schedule, loss_in_last_cell, sequential=False, devices=_K,
          **structure):
  """The graph and its (init, loss, grads, train, variables).

  structure: _Params' layers, splits, micro, decoder_layers, smoothing.
  """
  if not tf.flags.FLAGS.is_parsed():  # The decoder's attention reads one.
    tf.flags.FLAGS.mark_as_parsed()
  g = tf.Graph()
  with g.as_default(), gpipe_testlib.Cluster(devices):
    tf.random.set_seed(1)
    py_utils.GetOrCreateGlobalStepVar()
    net = _Params(schedule, loss_in_last_cell, **structure).Instantiate()
    rng = np.random.RandomState(0)
    ids = tf.constant(rng.randint(0, _VOCAB, [_T, _B]), tf.int32)
    labels = tf.constant(rng.randint(0, _VOCAB, [_T, _B]), tf.int32)
    # Weights differ per token: the pipeline must carry each micro-batch's.
    weights = tf.constant(rng.uniform(0.5, 1.5, [_T, _B]), tf.float32)
    paddings = tf.zeros([_T, _B])
    # A target of its own, padded at the end in some rows (the decoder's).
    target = tf.constant(rng.randint(0, _VOCAB, [_T, _B]), tf.int32)
    target_paddings = tf.constant(
        np.arange(_T)[:, None] >= rng.randint(2, _T + 1, [_B]), tf.float32)
    if not structure.get('decoder_layers'):
      target = target_paddings = None
    if sequential:
      xent, _ = net.FPropSequential(net.theta, ids, paddings, target,
                                    target_paddings, *[None] * 6, labels,
                                    weights)
    else:
      xent, _ = net.FPropDefaultTheta(ids, paddings, target, target_paddings,
                                      labels=labels, label_weights=weights)
    loss = tf.reduce_sum(xent)
    variables = net.vars.Flatten()
    grads = [tf.convert_to_tensor(x) for x in tf.gradients(
        loss, variables, colocate_gradients_with_ops=True)]
    with tf.control_dependencies(grads):
      train = tf.group([tf.assign_sub(v, 0.01 * dv)
                        for v, dv in zip(variables, grads)])
    init = tf.global_variables_initializer()
  return g, (init, loss, grads, train, variables)


def _Train(schedule, loss_in_last_cell, sequential=False, devices=_K,
           **structure):
  """(losses per step, first step's gradients, variables after, graph)."""
  g, (init, loss, grads, train, variables) = Build(
      schedule, loss_in_last_cell, sequential, devices, **structure)
  losses = []
  with gpipe_testlib.Session(g, devices) as sess:
    sess.run(init)
    first_grads = sess.run(grads)
    for _ in range(_STEPS):
      losses.append(sess.run([loss, train])[0])
    final = sess.run(variables)
  return losses, first_grads, final, g


def _Recomputes(graph):
  return any('recompute' in op.name for op in graph.get_operations())


@pytest.mark.slow  # Four Transformer graphs.
def test_1f1b_with_the_loss_in_the_last_cell_equals_the_default():
  ref = _Train('unrolled', False)  # Lingvo's loss, after the pipeline.
  seq = _Train('unrolled', True, sequential=True)
  runs = [_Train('unrolled', True), _Train('1f1b', True)]
  assert not _Recomputes(runs[1][3])  # The loss is linear in the outputs.
  for losses, grads, final, _ in [seq] + runs:
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    for a, b in zip(grads, ref[1]):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(final, ref[2]):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert ref[0][-1] < ref[0][0]  # It trains.


@pytest.mark.slow
def test_1f1b_with_the_loss_after_the_pipeline_recomputes():
  # The same model with Lingvo's loss: '1f1b' must recompute (the check
  # above can fail).
  _, _, _, g = _Train('1f1b', False)
  assert _Recomputes(g)


def _RandomStructure(schedule, seed):
  """Devices and a stack shape from a seeded generator: layers, cells (two
  per device for the schedules that place several), micro-batches."""
  rng = np.random.RandomState(seed)
  devices = int(rng.choice([1, 2]))
  per_device = 2 if schedule in ('interleaved_1f1b', 'zbv') else 1
  splits = devices * per_device
  return devices, dict(
      layers=int(rng.randint(splits, splits + 3)), splits=splits,
      # The schedules with several cells a device take a multiple of the
      # devices (a one-line error otherwise).
      micro=int(rng.choice([m for m in (1, 2, 4, 8)
                            if per_device == 1 or m % devices == 0])))


@pytest.mark.slow  # Two Transformer graphs per case.
@pytest.mark.parametrize('schedule', sorted(records.ACTION_SCHEDULES))
def test_random_structures_with_the_loss_in_the_last_cell_equal_sequential(
    schedule):
  seed = sorted(records.ACTION_SCHEDULES).index(schedule)
  devices, structure = _RandomStructure(schedule, seed)
  seq = _Train('unrolled', True, sequential=True, devices=devices,
               **structure)
  run = _Train(schedule, True, devices=devices, **structure)
  assert not _Recomputes(run[3]), (schedule, structure)
  np.testing.assert_allclose(run[0], seq[0], rtol=1e-5)
  for a, b in zip(run[1] + run[2], seq[1] + seq[2]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


_SMOOTHING = 0.1  # Lingvo MT's default uncertainty.


def _Seq2Seq(schedule, seed):
  """A seeded random encoder-decoder structure for `schedule`, with at
  least two micro-batches (each smoothed apart)."""
  devices, structure = _RandomStructure(schedule, seed)
  rng = np.random.RandomState(seed)
  structure['micro'] = max(2, structure['micro'])
  total = structure['layers'] + 1  # At least one of each.
  encoder = int(rng.randint(1, total))
  structure.update(layers=encoder, decoder_layers=total - encoder,
                   smoothing=_SMOOTHING)
  return devices, structure


@pytest.mark.slow  # Three encoder-decoder graphs.
def test_label_smoothing_in_the_last_cell_equals_lingvos_loss():
  # Lingvo's loss smooths the labels after the pipeline (its FProp): equal
  # losses and gradients mean the last cell smoothed each micro-batch alike.
  devices, structure = _Seq2Seq('1f1b', 101)
  ref = _Train('unrolled', False, devices=devices, **structure)  # Lingvo's.
  seq = _Train('unrolled', True, sequential=True, devices=devices,
               **structure)
  run = _Train('1f1b', True, devices=devices, **structure)
  assert not _Recomputes(run[3]), structure
  for losses, grads, final, _ in (seq, run):
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    for a, b in zip(grads + final, ref[1] + ref[2]):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# The schedules that run forwards first for a loss not linear in the outputs
# ('1f1b' is above).
_LIST_SCHEDULES = ('interleaved_1f1b', 'zbv', 'zero_bubble')


@pytest.mark.slow  # Two encoder-decoder graphs per case.
@pytest.mark.parametrize('schedule', _LIST_SCHEDULES)
def test_random_structures_with_label_smoothing_equal_sequential(schedule):
  seed = 10 + sorted(records.ACTION_SCHEDULES).index(schedule)
  devices, structure = _Seq2Seq(schedule, seed)
  seq = _Train('unrolled', True, sequential=True, devices=devices,
               **structure)
  run = _Train(schedule, True, devices=devices, **structure)
  assert not _Recomputes(run[3]), (schedule, structure)
  np.testing.assert_allclose(run[0], seq[0], rtol=1e-5)
  for a, b in zip(run[1] + run[2], seq[1] + seq[2]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_loss_in_last_cell_refuses_a_smoother_across_rows():
  class _Other(base_layer.BaseLayer):  # Not one of Lingvo's row-wise ones.
    pass

  with gpipe_testlib.Cluster(_K), pytest.raises(
      ValueError, match='takes label_smoothing of UniformLabelSmoother or '
      'LocalizedLabelSmoother, not _Other'):
    _Params('1f1b', True).Set(
        label_smoothing=_Other.Params()).Instantiate()


def test_loss_in_last_cell_needs_a_softmax():
  with gpipe_testlib.Cluster(_K), pytest.raises(
      ValueError, match='loss_in_last_cell=True needs softmax_tpl'):
    _Params('1f1b', True).Set(softmax_tpl=None).Instantiate()


def test_loss_in_last_cell_is_not_for_recurrent():
  with gpipe_testlib.Cluster(_K), pytest.raises(
      ValueError, match="does not run with schedule='recurrent'"):
    _Params('recurrent', True).Instantiate()


def test_loss_in_last_cell_needs_labels():
  with tf.Graph().as_default(), gpipe_testlib.Cluster(_K):
    net = _Params('1f1b', True).Instantiate()
    with pytest.raises(ValueError, match='needs labels and label_weights'):
      net.FPropDefaultTheta(tf.zeros([_T, _B], tf.int32), tf.zeros([_T, _B]))
