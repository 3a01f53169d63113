"""'shared': Lingvo's behaviour, one copy of each variable.

Every replica reads the one copy; tf.gradients sums the replicas' gradients
at the variable. A GradientSync of this strategy exists only to accumulate
over accumulate_steps > 1.
"""

import lingvo.compat as tf

from lingvo_ext.distributed.sync import base


class SharedSync(base.GradientSync, strategy='shared'):
  """One copy; the replicas' gradients summed where the variable is read."""

  def _Gradients(self, loss, paths, vmap, colocate):
    del paths  # The variables themselves are differentiated.
    xs = [v for _, v in vmap.FlattenItems()]
    return [tf.gradients(loss, xs, colocate_gradients_with_ops=colocate)]

  def _SyncVariable(self, path, per_replica, var):
    g = per_replica[0]
    return [self._Accumulate([g], var, g.device)]
