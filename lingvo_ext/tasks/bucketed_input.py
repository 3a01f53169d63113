"""Bucketed fixed-shape inputs whose batches really have the fixed shape.

Lingvo's `LmInput` with `fixed_input_shape=True` sets every batch's static
shape to the largest bucket's batch (`max(bucket_batch_limit)`), but a
bucket's batch holds only its own limit: Dev and Test tables such as
128/64/32/... give a [32, T] batch that the graph takes for [128, T]. Lingvo
then fails (`LINGVO ASSERT ... mismatch shape: x=[128 30] y=[32 30]`) or,
where nothing checks, counts wrong. `Padded(cls)` is `cls` with every batch
padded to that static shape by rows that no metric counts: `paddings` 1,
`weights` 0, `word_count` -1 (so the LM's `word_count + 1` end-of-sentence
word adds nothing); `Counted(cls)` is a Lingvo LM task that counts only the
real rows in `num_sentences` and `num_samples_in_batch` (which the evaler
counts its samples by). `ApplyPadding(cfg)` swaps both in where the limits
differ.

Lingvo's `NmtInput` sets a static batch only with `pad_to_max_seq_length`
and equal limits; its usual buckets (mixed `bucket_batch_limit`) give
batches of unknown size, which a pipeline cannot split. `Padded` pads its
batches too (`paddings` 1, `weights` 0; the time axis stays the bucket's),
and `Counted` makes a Lingvo MT task (`MTBaseModel`) count only real rows
in `num_samples_in_batch` and decode only those. See
docs/machine-translation.md and docs/troubleshooting.md.
"""

import functools

import lingvo.compat as tf
from lingvo.core import py_utils

# The value of each padded row, per batch field; others are padded with 0.
_PAD_VALUES = {'paddings': 1.0, 'word_count': -1}


def _NmtInput():
  try:
    from lingvo.tasks.mt import input_generator as mt_inp  # pylint: disable=g-import-not-at-top
  except ImportError:  # Lingvo's MT package needs tensorflow-probability.
    return None
  return mt_inp.NmtInput


def NeedsPadding(input_params):
  """Whether an LmInput's params give batches smaller than their shape, or
  an NmtInput's batches of no static size."""
  if input_params is None or not isinstance(
      getattr(input_params, 'cls', None), type):
    return False
  nmt = _NmtInput()
  from lingvo.tasks.lm import input_generator as lm_inp  # pylint: disable=g-import-not-at-top
  is_nmt = nmt is not None and issubclass(input_params.cls, nmt)
  if not (is_nmt or issubclass(input_params.cls, lm_inp.LmInput)):
    return False
  limits = set(input_params.bucket_batch_limit or [])
  if is_nmt:
    return not (input_params.pad_to_max_seq_length and len(limits) == 1)
  return bool(input_params.fixed_input_shape and len(limits) > 1)


def _Pad(t, name, rows):
  """`t` [batch, ...] padded to `rows` rows of `name`'s pad value."""
  pads = [[0, rows - tf.shape(t)[0]]] + [[0, 0]] * (t.shape.rank - 1)
  padded = tf.pad(t, pads, constant_values=tf.cast(
      _PAD_VALUES.get(name.split('.')[-1], 0), t.dtype))
  padded.set_shape([rows] + t.shape.as_list()[1:])
  return padded


class _PadsToFixedShape:
  """Mixed in before an LmInput class: its batches padded to the static
  batch (the largest bucket's)."""

  def BuildInputBatch(self, batch_size, features_list, bucket_keys=None):
    ret = super().BuildInputBatch(batch_size, features_list, bucket_keys)
    static = max(self.infeed_bucket_batch_limit)
    nmt = _NmtInput()
    if nmt is not None and isinstance(self, nmt):  # Nested: src, tgt.
      out = ret.Transform(tf.identity)
      for name, t in ret.FlattenItems():
        if name != 'bucket_keys':
          out.Set(name, _Pad(t, name, static))
      return out
    # The run-time batch: bucket_keys' shape is not set to the static one.
    size = tf.size(ret.bucket_keys)
    out = py_utils.NestedMap(bucket_keys=ret.bucket_keys)
    for name, t in ret.items():
      if name == 'bucket_keys':
        continue
      pads = [[0, static - size]] + [[0, 0]] * (t.shape.rank - 1)
      padded = tf.pad(t, pads, constant_values=tf.cast(
          _PAD_VALUES.get(name, 0), t.dtype))
      padded.set_shape(t.shape)
      out[name] = padded
    return out


@functools.lru_cache(maxsize=None)
def Padded(cls):
  """`cls` (an LmInput or NmtInput class), its batches padded to their
  static batch size."""
  return type(cls.__name__, (_PadsToFixedShape, cls),
              {'__module__': cls.__module__, '__doc__': cls.__doc__})


class _CountsRealRows:
  """Mixed in before a Lingvo LanguageModel class: padded rows (word_count
  -1) counted in no metric."""

  def FPropTower(self, theta, input_batch):
    metrics, per_example = super().FPropTower(theta, input_batch)
    real = input_batch.word_count >= 0
    rows = tf.reduce_sum(tf.cast(real, tf.int32))
    if 'num_sentences' in metrics:
      metrics['num_sentences'] = (tf.cast(
          rows, metrics['num_sentences'][0].dtype), 1)
    metrics['num_samples_in_batch'] = (rows, 1.0)
    if 'loss' in per_example:  # 0 / 0 on a padded row.
      loss = per_example['loss']
      per_example['loss'] = tf.where(real, loss, tf.zeros_like(loss))
    return metrics, per_example


class _CountsRealMtRows:
  """Mixed in before a Lingvo MT task class: padded rows (no source token)
  counted in no metric and not decoded."""

  def FPropTower(self, theta, input_batch):
    metrics, per_example = super().FPropTower(theta, input_batch)
    real = tf.reduce_sum(1.0 - input_batch.src.paddings, 1) > 0
    metrics['num_samples_in_batch'] = (
        tf.reduce_sum(tf.cast(real, tf.int32)), 1.0)
    return metrics, per_example

  def PostProcessDecodeOut(self, dec_out_dict, dec_metrics_dict):
    import numpy as np  # pylint: disable=g-import-not-at-top
    paddings = dec_out_dict.get('target_paddings')
    if paddings is not None:
      real = np.sum(1.0 - np.asarray(paddings), 1) > 0
      rows = len(real)
      dec_out_dict = {
          k: (np.asarray(v)[real] if len(np.shape(v)) and len(v) == rows
              else v) for k, v in dec_out_dict.items()}
    return super().PostProcessDecodeOut(dec_out_dict, dec_metrics_dict)


@functools.lru_cache(maxsize=None)
def Counted(cls):
  """`cls` (a Lingvo LanguageModel or MT task class) counting real rows
  only."""
  mixin = _CountsRealRows
  if _NmtInput() is not None:
    from lingvo.tasks.mt import model as mt_model  # pylint: disable=g-import-not-at-top
    if issubclass(cls, mt_model.MTBaseModel):
      mixin = _CountsRealMtRows
  return type(cls.__name__, (mixin, cls),
              {'__module__': cls.__module__, '__doc__': cls.__doc__})


def ApplyPadding(cfg):
  """Swaps `Padded` in for `cfg.input`'s class where its buckets need it,
  and `Counted` for a Lingvo LM task's.

  Args:
    cfg: An experiment's params for one dataset (with `input`).

  Returns:
    `cfg` (changed in place).
  """
  if 'input' in cfg and NeedsPadding(cfg.input) and not issubclass(
      cfg.input.cls, _PadsToFixedShape):
    cfg.input.cls = Padded(cfg.input.cls)
    task = cfg.task if 'task' in cfg else None
    from lingvo.tasks.lm import model as lm_model  # pylint: disable=g-import-not-at-top
    counted = [lm_model.LanguageModel]
    if _NmtInput() is not None and issubclass(cfg.input.cls, _NmtInput()):
      from lingvo.tasks.mt import model as mt_model  # pylint: disable=g-import-not-at-top
      counted = [mt_model.MTBaseModel]
    if (task is not None and isinstance(task.cls, type) and
        issubclass(task.cls, tuple(counted)) and
        not issubclass(task.cls, (_CountsRealRows, _CountsRealMtRows))):
      task.cls = Counted(task.cls)
  return cfg
