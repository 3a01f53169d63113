"""'parameter_server': one copy on a ps device, fed through accumulators.

Every replica's gradient goes into a ConditionalAccumulator (dense) or
SparseConditionalAccumulator (sparse) on the variable's device, and the
variable is updated once all R gradients have arrived (AutoDist's PS
synchroniser).
"""

import lingvo.compat as tf

from lingvo_ext.distributed.sync import base


class ParameterServerSync(base.GradientSync, strategy='parameter_server'):
  """One copy; its accumulator releases the mean of the R gradients."""

  def _PlanOf(self, path):
    return 'ps'

  def _SyncVariable(self, path, per_replica, var):
    return self._PushToPs(per_replica, var)

  def _PushToPs(self, per_replica, var):
    """One Pending mean of `per_replica` (every replica's), with `var`."""
    g0 = per_replica[0]
    if isinstance(g0, tf.IndexedSlices):
      self.stats.ps_push_bytes += (
          base.NumBytes(g0.values.shape, g0.values.dtype) +
          base.NumBytes(g0.indices.shape, tf.int64))
    else:
      self.stats.ps_push_bytes += base.NumBytes(g0.shape, g0.dtype)
    # The accumulator lives with the variable and releases one mean once
    # all R gradients arrived.
    pending = self._Accumulate(per_replica, var, var.device, force=True)
    return [pending] * self._r
