"""An exact pass over a finite Dev/Test input (--eval_one_pass).

Lingvo's evaler and decoder score `samples_per_summary` examples rounded up
to whole batches, in the order the input reads them (random for its
record-file inputs): some examples count twice, others not at all.
`OnePass(cfg)` sets a job's params to Lingvo's "the whole dataset": the
input read sequentially (`cluster.require_sequential_input_order`), once
(`repeat_count=1`), until it ends (`samples_per_summary=0`). Each bucket's
last batch is then partial; an NmtInput with static batches
(`pad_to_max_seq_length`, equal limits) fixes their shape, so its partial
batches are padded to the limit first, by rows no metric counts (the MT
task counts and decodes real rows only, `bucketed_input.Counted`); NmtInput's
mixed limits are padded by `bucketed_input.Padded` already. See
docs/machine-translation.md.
"""

import functools

import lingvo.compat as tf

from lingvo_ext.tasks import bucketed_input

# NmtInput's features, in its order: their values on a padded row.
_NMT_PAD_VALUES = (0, 1.0, 0, 1.0, 0, 0.0)  # src ids, paddings; tgt ids,
# paddings, labels, weights.


def _PadRows(t, rows, value):
  """`t` [batch, ...] (its rank known at run time only) padded to `rows`."""
  pads = tf.concat([[[0, rows - tf.shape(t)[0]]],
                    tf.zeros([tf.rank(t) - 1, 2], tf.int32)], 0)
  return tf.pad(t, pads, constant_values=tf.cast(value, t.dtype))


class _PadsPartialNmtBatches:
  """Mixed in before an NmtInput class with static batches: a partial
  batch padded to the batch limit before NmtInput fixes its shape."""

  def BuildInputBatch(self, batch_size, features_list, bucket_keys=None):
    rows = max(self.infeed_bucket_batch_limit)
    features = [_PadRows(t, rows, v)
                for t, v in zip(features_list, _NMT_PAD_VALUES)]
    if bucket_keys is not None:
      bucket_keys = _PadRows(bucket_keys, rows, 0)
    return super().BuildInputBatch(batch_size, features, bucket_keys)


@functools.lru_cache(maxsize=None)
def _PadsPartial(cls):
  return type(cls.__name__, (_PadsPartialNmtBatches, cls),
              {'__module__': cls.__module__, '__doc__': cls.__doc__})


def _IsStaticNmtInput(p):
  try:
    from lingvo.tasks.mt import input_generator  # pylint: disable=g-import-not-at-top
  except ImportError:  # Lingvo's MT package needs tensorflow-probability.
    return False
  return (isinstance(p.cls, type) and
          issubclass(p.cls, input_generator.NmtInput) and
          not bucketed_input.NeedsPadding(p))


def OnePass(cfg):
  """Sets a job's params (one dataset's) to read its finite input once, in
  order; changed in place."""
  cfg.cluster.require_sequential_input_order = True
  inp = cfg.input
  if 'repeat_count' in inp:
    inp.repeat_count = 1
  inp.resettable = True  # Lingvo stops at the input's end only then.
  if 'eval_samples_per_summary' in inp:
    inp.eval_samples_per_summary = 0
  if 'task' in cfg:
    cfg.task.eval.samples_per_summary = 0
    cfg.task.eval.decoder_samples_per_summary = 0
  if _IsStaticNmtInput(inp) and not issubclass(inp.cls,
                                               _PadsPartialNmtBatches):
    inp.cls = _PadsPartial(inp.cls)
    if 'task' in cfg and isinstance(cfg.task.cls, type):
      cfg.task.cls = bucketed_input.Counted(cfg.task.cls)
  return cfg
