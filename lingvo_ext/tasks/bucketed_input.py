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
differ. See docs/troubleshooting.md.
"""

import functools

import lingvo.compat as tf
from lingvo.core import py_utils

# The value of each padded row, per batch field; others are padded with 0.
_PAD_VALUES = {'paddings': 1.0, 'word_count': -1}


def NeedsPadding(input_params):
  """Whether an LmInput's params give batches smaller than their shape."""
  if input_params is None or not isinstance(
      getattr(input_params, 'cls', None), type):
    return False
  from lingvo.tasks.lm import input_generator as lm_inp  # pylint: disable=g-import-not-at-top
  if not issubclass(input_params.cls, lm_inp.LmInput):
    return False
  limits = list(input_params.bucket_batch_limit or [])
  return bool(input_params.fixed_input_shape and len(set(limits)) > 1)


class _PadsToFixedShape:
  """Mixed in before an LmInput class: its batches padded to the static
  batch (the largest bucket's)."""

  def BuildInputBatch(self, batch_size, features_list, bucket_keys=None):
    ret = super().BuildInputBatch(batch_size, features_list, bucket_keys)
    static = max(self.infeed_bucket_batch_limit)
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
  """`cls` (an LmInput class) with batches padded to their static shape."""
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


@functools.lru_cache(maxsize=None)
def Counted(cls):
  """`cls` (a Lingvo LanguageModel class) counting real rows only."""
  return type(cls.__name__, (_CountsRealRows, cls),
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
    if (task is not None and isinstance(task.cls, type) and
        issubclass(task.cls, lm_model.LanguageModel) and
        not issubclass(task.cls, _CountsRealRows)):
      task.cls = Counted(task.cls)
  return cfg
