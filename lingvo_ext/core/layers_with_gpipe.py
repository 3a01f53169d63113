"""Lingvo's GPipe Transformer stacks, on lingvo_ext's PipeliningLayer.

`lingvo.core.layers_with_gpipe` builds `GPipeTransformerStack`,
`GPipeEvolvedTransformerStack` and `GPipeBatchMajorTransformerStack` (and
their layers) on `lingvo.core.gpipe`. This module is the installed Lingvo
module itself, executed once more with `lingvo_ext.core.gpipe` standing in
for `lingvo.core.gpipe`, so its stacks are lingvo_ext `PipeliningLayer`s
(schedules, checks) with Lingvo's params, variable names and outputs.
Switch by changing the import::

    from lingvo_ext.core import layers_with_gpipe
    p = layers_with_gpipe.GPipeTransformerStack.Params().Set(...)

Its classes are distinct from `lingvo.core.layers_with_gpipe`'s (so an
`isinstance` against Lingvo's stack is False); everything else in the module
is Lingvo's, but for one param of `GPipeTransformerStack`: `loss_in_last_cell`
computes the per-example cross-entropy in the last cell (the pipeline carries
the labels to it), so the loss is linear in the pipeline's outputs and '1f1b'
runs without recomputing (docs/schedules.md). With `label_smoothing` (Lingvo's
`UniformLabelSmoother`, Lingvo MT's default) the last cell smooths each
micro-batch's labels as Lingvo's FProp smooths the batch's: a smoothed
cross-entropy is still a sum over tokens.
"""

import lingvo.compat as tf
from lingvo.core import gpipe as _lingvo_gpipe  # noqa: F401  # pylint: disable=unused-import
from lingvo.core import layers as lingvo_layers
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext.core import gpipe as _ext_gpipe

_LINGVO_MODULE = 'lingvo.core.layers_with_gpipe'
_GPIPE_MODULE = 'lingvo.core.gpipe'

_module = internal_lingvo.ExecModuleWith(_LINGVO_MODULE,
                                         {_GPIPE_MODULE: _ext_gpipe})
if _module.PipeliningLayer is not _ext_gpipe.PipeliningLayer:
  raise ImportError('%s did not take PipeliningLayer from %s.' %
                    (_LINGVO_MODULE, _GPIPE_MODULE))
for _name, _value in vars(_module).items():
  if not _name.startswith('__'):
    globals()[_name] = _value
# Classes report this module, so their params print where they come from.
for _value in list(globals().values()):
  if (isinstance(_value, type) and
      getattr(_value, '__module__', None) == _LINGVO_MODULE):
    _value.__module__ = __name__
del _name, _value

# The cell inputs the pipeline carries to the loss: labels, label_weights.
_NUM_LABEL_INPUTS = 2


class GPipeTransformerXentCell(_ext_gpipe.FeatureExtractionLayer):
  """The last cell with the loss in it: `sub` (ending in the softmax layer
  'softmax') on all inputs but the last two, (labels, label_weights); then
  the per-example cross-entropy, against `label_smoothing`'s targets if set.
  Returns (per-example xent, logits)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('label_smoothing', None,
             "The stack's label smoother params (a row-wise smoother), or "
             'None for one-hot targets.')
    p.Define('batch_dim', 1, "The stack's batch_dim (1: time-major).")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.label_smoothing:
      self.CreateChild('smoother', p.label_smoothing)

  def _SmoothedTargets(self, theta, inputs, labels):
    """Lingvo's GPipeTransformerStack.FProp smoothing, on this micro-batch:
    [tokens, num_classes] target probabilities, or None."""
    p = self.params
    if not p.label_smoothing:
      return None
    # The cells' states: (source_vecs, source_paddings, target_vecs,
    # target_paddings, ...).
    paddings = inputs[3] if len(inputs) > 3 else None
    if p.batch_dim:  # Time-major: the smoother takes [batch, time].
      probs = tf.transpose(
          self.smoother.FProp(
              theta.smoother,
              None if paddings is None else tf.transpose(paddings),
              tf.transpose(labels), target_ids=None), [1, 0, 2])
    else:
      probs = self.smoother.FProp(theta.smoother, paddings, labels,
                                  target_ids=None)
    return tf.reshape(probs, [-1, self.softmax.params.num_classes])

  def FProp(self, theta, *args):
    inputs, labels, weights = args[:-2], args[-2], args[-1]
    logits = super().FProp(theta, *inputs)
    num_classes = self.softmax.params.num_classes
    xent, _ = self.softmax.XentLossFromLogits(
        theta.softmax, tf.reshape(logits, [-1, num_classes]),
        class_weights=tf.reshape(weights, [-1]),
        class_ids=tf.reshape(labels, [-1]),
        class_probabilities=self._SmoothedTargets(theta, inputs, labels))
    return tf.reshape(xent, tf.shape(logits)[:2]), logits

  @classmethod
  def FPropMeta(cls, p, *args):
    meta = super().FPropMeta(p, *args[:-_NUM_LABEL_INPUTS])
    logits = meta.out_shapes[0]
    return py_utils.NestedMap(
        flops=meta.flops,
        out_shapes=(tshape.Shape(logits[:2]), logits))


# Smoothers whose targets for a sequence depend on that sequence alone, so
# smoothing each micro-batch equals smoothing the batch.
_ROW_WISE_SMOOTHERS = (lingvo_layers.UniformLabelSmoother,
                       lingvo_layers.LocalizedLabelSmoother)


class _LossInLastCell(_ext_gpipe.PipeliningLayer):
  """Between Lingvo's stack and PipeliningLayer in the MRO: rewrites the
  cells Lingvo's __init__ built before PipeliningLayer creates them."""

  def __init__(self, params):
    p = params
    if p.loss_in_last_cell:
      if not p.softmax_tpl:
        raise ValueError(
            '%s: loss_in_last_cell=True needs softmax_tpl; set '
            'loss_in_last_cell=False.' % p.name)
      if p.label_smoothing and not issubclass(p.label_smoothing.cls,
                                              _ROW_WISE_SMOOTHERS):
        raise ValueError(
            '%s: loss_in_last_cell=True smooths each micro-batch apart and '
            'takes label_smoothing of %s, not %s; set '
            'loss_in_last_cell=False.' %
            (p.name, ' or '.join(c.__name__ for c in _ROW_WISE_SMOOTHERS),
             p.label_smoothing.cls.__name__))
      if p.schedule == 'recurrent':
        # Its loop passes states of one dtype; the labels are integers.
        raise ValueError(
            "%s: loss_in_last_cell=True does not run with schedule="
            "'recurrent'; use another schedule or loss_in_last_cell=False."
            % p.name)
      cells = list(p.cell_tpl)
      for cell in cells[:-1]:
        cell.num_act_inputs = cell.num_act_outputs = _NUM_LABEL_INPUTS
      last = cells[-1]
      cells[-1] = GPipeTransformerXentCell.Params().Set(
          name=last.name, sub=last.sub,
          label_smoothing=p.label_smoothing and p.label_smoothing.Copy(),
          batch_dim=p.batch_dim)
      p.cell_tpl = cells
    super().__init__(p)


class GPipeTransformerStack(_module.GPipeTransformerStack, _LossInLastCell):
  """Lingvo's GPipeTransformerStack; `loss_in_last_cell` puts the loss in
  the last cell."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'loss_in_last_cell', False,
        'If True, the last cell computes the per-example cross-entropy (same '
        "outputs, label_smoothing too): the loss is linear in the pipeline's "
        "outputs, so '1f1b' does not recompute. See docs/schedules.md.")
    return p

  def FProp(self, theta, source_input, source_paddings, target_input=None,
            target_paddings=None, source_segment_id=None,
            target_segment_id=None, labels=None, label_weights=None,
            source_segment_pos=None, target_segment_pos=None,
            source_task_id=None, target_task_id=None):
    """Lingvo's FProp: (per-example xent, logits), or logits without
    softmax_tpl."""
    p = self.params
    if not p.loss_in_last_cell:
      return super().FProp(
          theta, source_input, source_paddings, target_input,
          target_paddings, source_segment_id, target_segment_id, labels,
          label_weights, source_segment_pos, target_segment_pos,
          source_task_id, target_task_id)
    if labels is None or label_weights is None:
      raise ValueError('%s: loss_in_last_cell=True needs labels and '
                       'label_weights.' % p.name)
    if p.num_decoder_layers > 0 and (target_input is None or
                                     target_paddings is None):
      raise ValueError('%s: decoder layers need target_input and '
                       'target_paddings.' % p.name)
    if p.packed_input and (source_segment_id is None or
                           source_segment_pos is None):
      raise ValueError('%s: packed_input=True needs source_segment_id and '
                       'source_segment_pos.' % p.name)
    return _ext_gpipe.PipeliningLayer.FProp(
        self, theta, source_input, source_paddings, target_input,
        target_paddings, source_segment_id, target_segment_id,
        source_segment_pos, target_segment_pos, source_task_id,
        target_task_id, labels, label_weights)


GPipeTransformerStack.__module__ = __name__
