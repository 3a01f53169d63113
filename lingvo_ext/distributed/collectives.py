"""Collective ops of data-parallel replicas: all-reduce and all-gather.

The replicas of one graph (one per split) meet in TensorFlow's
CollectiveReduceV2 / CollectiveGatherV2 (tf.raw_ops), one group per pipeline
stage; keys are derived from names so that every process agrees on them.
"""

import zlib

import lingvo.compat as tf


def StableKey(text: str) -> int:
  """A positive int32 key derived from `text`, the same in every process."""
  return zlib.crc32(text.encode('utf-8')) % (2**31 - 2**20) + 2**20


def AllReduceMean(grads, devices, group_key, instance_key, compression='none'):
  """Mean of the replicas' dense gradients with CollectiveReduceV2.

  Args:
    grads: One tensor per replica, all of one shape.
    devices: The device of each replica's collective op, all distinct.
    group_key: The collective group of these devices.
    instance_key: This reduction's key, the same on every replica.
    compression: 'fp16' sends float16 and returns the input dtype.

  Returns:
    One tensor per replica, each the sum of `grads` divided by len(grads).
  """
  out = []
  for g, d in zip(grads, devices):
    with tf.device(d):
      x = tf.cast(g, tf.float16) if compression == 'fp16' else g
      y = tf.raw_ops.CollectiveReduceV2(
          input=x, group_size=len(grads), group_key=group_key,
          instance_key=instance_key, ordering_token=[], merge_op='Add',
          final_op='Div')
      out.append(tf.cast(y, g.dtype) if compression == 'fp16' else y)
  return out


def AllGatherSlices(grads, devices, group_key, instance_key):
  """Concatenates the replicas' IndexedSlices with CollectiveGatherV2.

  Indices and values are gathered in replica order and values divided by R,
  so the sum the optimizer applies is the replicas' mean. Nothing is
  densified. Slices of different static sizes are padded to the largest
  (the padding rows are dropped after the gather).

  Args:
    grads: One tf.IndexedSlices per replica, of one dense shape.
    devices: The device of each replica's collective ops.
    group_key: The collective group of these devices.
    instance_key: Key of the values' gather; the indices use the next key,
      the sizes (when padding) the one after.

  Returns:
    One tf.IndexedSlices per replica, identical on all.
  """
  r = len(grads)
  sizes = [g.values.shape[0] for g in grads]
  equal = None not in sizes and len(set(sizes)) == 1
  out = []
  for g, d in zip(grads, devices):
    with tf.device(d):
      values, indices = g.values, tf.cast(g.indices, tf.int64)
      if not equal:
        n = tf.shape(values)[:1]
        counts = _AllGather(n, r, group_key, instance_key + 2)
        longest = tf.reduce_max(counts)
        pad = longest - n[0]
        values = tf.pad(values, [[0, pad]] + [[0, 0]] *
                        (values.shape.rank - 1))
        indices = tf.pad(indices, [[0, pad]])
      values = _AllGather(values, r, group_key, instance_key)
      indices = _AllGather(indices, r, group_key, instance_key + 1)
      if not equal:
        keep = tf.reshape(tf.sequence_mask(counts, longest), [-1])
        values = tf.boolean_mask(values, keep)
        indices = tf.boolean_mask(indices, keep)
      out.append(
          tf.IndexedSlices(values / tf.cast(r, values.dtype), indices,
                           g.dense_shape))
  return out


def _AllGather(x, group_size, group_key, instance_key):
  return tf.raw_ops.CollectiveGatherV2(
      input=x, group_size=group_size, group_key=group_key,
      instance_key=instance_key, ordering_token=[])
