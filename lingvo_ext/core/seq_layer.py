"""SeqLayer: a layer's cells run in sequence, each on its device.

Where each cell and its variables are placed (`CellVariableDevices`), and how
cell variables are named (Lingvo's, or without the cell scope so that a
checkpoint restores under any cut). `PipeliningLayer`
(`lingvo_ext.core.gpipe`) builds on it.
"""

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import py_utils

from lingvo_ext.core import stacking
from lingvo_ext.pipeline import cells
from lingvo_ext.pipeline import kinds
from lingvo_ext.pipeline import nest_util
from lingvo_ext.pipeline import records


def CellVariableDevices(cluster, num_cells: int,
                        placement: str = 'round_robin') -> list:
  """The device of each cell's variables: the one that runs it in replica 0.

  Only where variables live on the worker devices (the ps devices are the
  worker devices, as in Lingvo's sync mode) and a split has several devices;
  otherwise '' for every cell (the enclosing placer decides). It reads only
  the cluster's worker and ps specs, which every job (controller, trainer,
  evaler) builds alike, so their graphs agree on each variable's device.

  Args:
    cluster: A Lingvo cluster.
    num_cells: The number of cells.
    placement: How cells sit on the split's devices (`kinds.PLACEMENTS`).

  Returns:
    A list of `num_cells` device strings.
  """
  cp = cluster.params
  per_split = cp.worker.devices_per_split
  if num_cells < 2 or per_split < 2:
    return [''] * num_cells
  workers = cluster.ListDevices(cp.worker).flatten().tolist()
  ps = cluster.ListDevices(cp.ps).flatten().tolist()
  if (not all(workers) or len(workers) < per_split or
      sorted(ps) != sorted(workers)):
    return [''] * num_cells
  return [workers[kinds.PlaceStage(placement, per_split, i)]
          for i in range(num_cells)]


class SeqLayer(base_layer.BaseLayer):
  """Runs `before_tpl`, then each cell of `cell_tpl` on its own device.

  Cell i runs on `cluster.WorkerDeviceInModelSplit(i)`, which wraps round-robin
  when there are more cells than devices in the split. As in Lingvo, this
  layer's own name is not in its children's variable names, the cells' are:
  `<parent scope>/<cell>/<sub-layer>/...`, e.g. `model/d0/cell_000/w/var`.
  With `partition_independent_names=True` the FeatureExtractionLayer cells'
  scope is dropped too (`model/cell_000/w/var`), so names do not depend on
  how the stack was partitioned.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('before_tpl', [],
             'Layers run on the first device before the cells.')
    p.Define('cell_tpl', [], 'A list of FeatureExtractionLayer params.')
    p.Define(
        'partition_independent_names', False,
        'False: lingvo.core.gpipe\'s variable names (d0/cell_000/w). True: '
        'no cell scope (cell_000/w), so a checkpoint restores under any '
        'partitioning. See docs/checkpoints.md.')
    p.Define(
        'colocate_cell_variables', True,
        'If True, each cell\'s variables live on the device that runs the '
        'cell; False leaves them to the enclosing placer, as '
        'lingvo.core.gpipe does. See docs/clusters.md.')
    p.Define(
        'stack_variables', False,
        'If True, same-shape variables of the layers in a cell are one '
        '[n, ...] variable; checkpoints keep per-layer names. See '
        'docs/performance.md.')
    p.Define(
        'max_combined_variable_size',
        stacking.DEFAULT_MAX_COMBINED_VARIABLE_SIZE,
        'stack_variables=True: the largest stacked variable, in bytes; '
        'bigger groups are split.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not p.cell_tpl:
      raise ValueError(
          '%s: cell_tpl is empty; give it a list of FeatureExtractionLayer '
          'params, e.g. from PartitionSequentialLayers(layers, '
          'num_partitions, *input_shapes).' % p.name)
    if p.partition_independent_names:
      self._CheckUniqueSubLayerNames()
    self._before_layers = []
    self._cells = []
    before_tpl_device = ''
    cell_devices = [''] * len(p.cell_tpl)
    # Where the schedule places each cell (PipeliningLayer's records).
    record = records.BY_NAME.get(p.schedule) if 'schedule' in p else None
    placement = record.placement if record else 'round_robin'
    if py_utils.use_tpu():
      before_tpl_device = self.cluster.WorkerDeviceInModelSplit(0)
      per_split = self.cluster.num_devices_per_split
      cell_devices = [
          self.cluster.WorkerDeviceInModelSplit(
              kinds.PlaceStage(placement, per_split, i))
          for i in range(len(p.cell_tpl))
      ]
    elif p.colocate_cell_variables:
      cell_devices = CellVariableDevices(self.cluster, len(p.cell_tpl),
                                         placement)
      before_tpl_device = cell_devices[0]
    for l in p.before_tpl:
      with tf.device(before_tpl_device):
        self.CreateChild(l.name, l)
      self._before_layers.append((l.name, self.children[l.name]))
    cell_tpl = p.cell_tpl
    if p.partition_independent_names:
      cell_tpl = [self._WithoutCellScope(l) for l in cell_tpl]
    stacker = None
    if p.stack_variables:
      stacker = stacking.VariableStacker(p.max_combined_variable_size)
    for i, l in enumerate(cell_tpl):
      with tf.device(cell_devices[i]):
        if stacker:
          with stacker.Record():
            self.CreateChild(l.name, l)
          # One stacked variable per group in each cell, so per device.
          for key, var in stacker.Stack(self.children[l.name], l.name).items():
            self._private_vars[key] = var
            self._private_theta[key] = var
        else:
          self.CreateChild(l.name, l)
      self._cells.append((l.name, self.children[l.name]))

  @staticmethod
  def _DropsCellScope(cell_p):
    return cell_p.cls in (cells.FeatureExtractionLayer,
                          lingvo_gpipe.FeatureExtractionLayer)

  def _CheckUniqueSubLayerNames(self):
    """With the cell scope dropped, sub-layer names must not collide."""
    p = self.params
    seen = {}
    for l in p.cell_tpl:
      if not self._DropsCellScope(l):
        continue  # Its variables keep the cell's scope.
      for sub in l.sub or []:
        name = l.variable_name_prefix + sub.name
        if name in seen:
          raise ValueError(
              '%s: cells %r and %r both have a sub-layer named %r; with '
              'partition_independent_names=True cell variables are named by '
              'sub-layer alone, so give them distinct names '
              '(PartitionSequentialLayers names them cell_000, ...) or set '
              'partition_independent_names=False.' %
              (p.name, seen[name], l.name, name))
        seen[name] = l.name

  def _WithoutCellScope(self, cell_p):
    """Names a cell's sub-layer variables as if the cell were not there.

    With neither this layer's nor the cell's scope in the names, a variable's
    name depends on its layer alone, not on how the stack was partitioned:
    the same model cut into 1 or K cells has the same variables, and a
    checkpoint restores under any partitioning.

    Args:
      cell_p: A cell's params.

    Returns:
      A copy of cell_p with child_variable_scope_override set for its subs.
    """
    if not self._DropsCellScope(cell_p):
      return cell_p
    cell_p = cell_p.Copy()
    overrides = dict(cell_p.child_variable_scope_override or {})
    for sub in cell_p.sub:
      overrides.setdefault(cell_p.variable_name_prefix + sub.name, [])
    cell_p.child_variable_scope_override = overrides
    return cell_p

  def _child_variable_scope_override(self):
    # As Lingvo: children sit in this layer's parent scope, not its own.
    p = self.params
    res = super()._child_variable_scope_override()
    for l in p.before_tpl + p.cell_tpl:
      res[l.name] = []
    return res

  def FProp(self, theta, *args):
    """Runs the before layers, then the cells in sequence on their devices.

    Args:
      theta: A NestedMap of this layer's and its children's weights.
      *args: Input tensors.

    Returns:
      The last cell's outputs.
    """
    for (name, l) in self._before_layers:
      args = l.FProp(theta[name], *nest_util.ToTuple(args))
    for i, (name, cell) in enumerate(self._cells):
      with tf.device(self.cluster.WorkerDeviceInModelSplit(i)):
        args = cell.FProp(theta[name], *nest_util.ToTuple(args))
    return args
