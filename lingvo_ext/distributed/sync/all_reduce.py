"""'all_reduce': a copy of each variable per replica, gradients all-reduced.

Every replica keeps its own copy of each variable on its own devices
(replica 0's copy is the variable of the checkpoint, under the original
name; the others are local variables, copied from it when a trainer starts).
Dense gradients are all-reduced with TensorFlow's CollectiveReduceV2 (sum,
then divide by R), sparse ones (tf.IndexedSlices) all-gathered, indices and
values, with CollectiveGatherV2, never densified. Every replica applies the
same update to its copy.
"""

import lingvo.compat as tf

from lingvo_ext.distributed import collectives
from lingvo_ext.distributed.sync import base

# Collective groups: one per pipeline stage (its members are the R replicas'
# devices of that stage); keys above this base.
_GROUP_KEY_BASE = 1000


class AllReduceSync(base.GradientSync, strategy='all_reduce'):
  """A copy per replica; each variable's gradients all-reduced in its stage."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._keys = {}

  def _InstanceKey(self, text):
    """A key derived from `text`; unique among this graph's keys."""
    if text not in self._keys:
      key = collectives.StableKey(text)
      used = set(self._keys.values())
      while any(k in used for k in range(key, key + 3)):
        key += 3  # Each collective may use key, key + 1 and key + 2.
      self._keys[text] = key
    return self._keys[text]

  def _GroupKey(self, stage):
    return _GROUP_KEY_BASE + stage

  def _PlanOf(self, path):
    return 'replicated'

  def _SyncVariable(self, path, per_replica, var):
    return self._AllReduce(path, per_replica, var)

  def _AllReduce(self, path, per_replica, var):
    """Each replica's Pending mean of `per_replica`, on its own devices."""
    devices = [self._devices[r][path] for r in range(self._r)]
    group = self._GroupKey(self._stages[path])
    key = self._InstanceKey(var.op.name)
    with tf.name_scope('all_reduce'):
      if isinstance(per_replica[0], tf.IndexedSlices):
        g0 = per_replica[0]
        self.stats.sparse_all_gather_bytes += (
            base.NumBytes(g0.values.shape, g0.values.dtype) +
            base.NumBytes(g0.indices.shape, tf.int64))
        self.stats.sparse_densified_bytes += base.NumBytes(var.shape,
                                                           var.dtype)
        reduced = collectives.AllGatherSlices(per_replica, devices, group, key)
      else:
        size = base.NumBytes(per_replica[0].shape, per_replica[0].dtype)
        if self._compression == 'fp16':
          size //= 2
        self.stats.dense_all_reduce_bytes += size
        reduced = collectives.AllReduceMean(per_replica, devices, group, key,
                                            self._compression)
    out = []
    for r in range(self._r):
      with tf.device(devices[r]):
        out.append(self._Accumulate([reduced[r]], var, devices[r]))
    return out
