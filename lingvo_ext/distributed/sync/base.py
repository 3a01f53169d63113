"""What every gradient-sync strategy does: replicas' reads, the step's update.

The task calls `ReplicaTheta(r, ...)` for each replica r, which reads the
variables through the strategy's copies; a learner's Apply (see learners.py)
calls `Apply`, which takes each replica's gradient of R times the global
loss, hands each variable's R gradients to the strategy (`_SyncVariable`),
accumulates them over accumulate_steps (accumulation.py), then clips and
applies them to every replica's copies. A strategy is a subclass that
decides each variable's plan (`_PlanOf`: 'replicated' copies per replica, or
one copy fed through a 'ps' accumulator) and how its gradients meet
(`_SyncVariable`); `GradientSync(name, strategy, ...)` makes the subclass of
that strategy.
"""

import dataclasses

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
import numpy as np

from lingvo_ext.distributed import accumulation
from lingvo_ext.distributed.sync import replica_state


def NumBytes(shape, dtype):
  """Bytes of a tensor of static `shape` and `dtype`."""
  return int(np.prod(shape.as_list())) * tf.as_dtype(dtype).size


@dataclasses.dataclass
class CommunicationStats:
  """Bytes one replica sends per step, from the static shapes of the graph.

  dense_all_reduce_bytes: dense gradients entering CollectiveReduce.
  sparse_all_gather_bytes: IndexedSlices (values and indices) entering
    CollectiveGather.
  sparse_densified_bytes: what all-reducing those gradients dense would send.
  ps_push_bytes: gradients pushed into accumulators on ps devices.
  """
  dense_all_reduce_bytes: int = 0
  sparse_all_gather_bytes: int = 0
  sparse_densified_bytes: int = 0
  ps_push_bytes: int = 0


class GradientSync:
  """Builds the replicas' variable reads and the synchronised update.

  The task calls `ReplicaTheta(r, ...)` for r = 0..R-1 in order, each inside
  replica r's model split, then builds its train ops inside `Applying(sync)`:
  its learners (SyncLearner, see WithSyncLearners) apply through `Apply`.
  `GradientSync(name, strategy, ...)` gives an instance of the subclass
  registered for `strategy` (`class X(GradientSync, strategy='...')`).
  """

  STRATEGY = None
  _CLASSES = {}  # Strategy name -> its subclass.

  def __init_subclass__(cls, strategy=None, **kwargs):
    super().__init_subclass__(**kwargs)
    if strategy is not None:
      cls.STRATEGY = strategy
      GradientSync._CLASSES[strategy] = cls

  def __new__(cls, name, strategy, *args, **kwargs):
    del args, kwargs  # For __init__.
    if cls is GradientSync:
      if strategy not in GradientSync._CLASSES:
        raise ValueError(
            f'{name}: gradient_sync={strategy!r} is not a strategy; set '
            f'task.gradient_sync to one of {", ".join(GradientSync._CLASSES)}.')
      cls = GradientSync._CLASSES[strategy]
    return super().__new__(cls)

  def __init__(self, name, strategy, num_replicas, accumulate_steps=1,
               compression='none'):
    self._name = name
    self._strategy = strategy
    self._r = num_replicas
    self._n = accumulate_steps
    self._compression = compression
    self._reads = [{} for _ in range(num_replicas)]  # Path -> read tensor.
    self._devices = [{} for _ in range(num_replicas)]  # Path -> device.
    self._stages = {}  # Path -> pipeline stage.
    self._masters = {}  # Path -> variable (replica 0's copy).
    self._plans = {}  # Path -> 'replicated' or 'ps'.
    self._mirrors = {}  # (replica, path) -> local variable.
    self._synced = None  # Local bool: mirrors and their slots are in sync.
    self._copy_vars = None
    self.stats = CommunicationStats()
    self.accumulators = []  # For graph checks: (variable, accumulator).

  @property
  def num_replicas(self):
    return self._r

  # The strategy's part.

  def _PlanOf(self, path):
    """'replicated' (a copy per replica) or 'ps' (one copy) for `path`."""
    raise NotImplementedError(type(self).__name__)

  def _SyncVariable(self, path, per_replica, var):
    """The Pending gradient of each target replica for variable `path`.

    Args:
      path: The variable's path.
      per_replica: Its gradient in each replica (one for 'shared').
      var: The variable (replica 0's copy).

    Returns:
      A list of accumulation.Pending, one per entry of `per_replica`.
    """
    raise NotImplementedError(type(self).__name__)

  def _Gradients(self, loss, paths, vmap, colocate):
    """Per replica, the gradients of `paths` (a list of lists)."""
    del vmap  # The replicas' reads stand for the variables.
    missing = [x for x in paths if x not in self._reads[0]]
    if missing:
      raise ValueError(f'{self._name}: variables {missing} were not read '
                       'through ReplicaTheta.')
    if not self._plans:  # One replica: planned here, not at replica 1.
      self._Plan(dict(self._masters))
    xs = [self._reads[r][x] for r in range(self._r) for x in paths]
    flat = tf.gradients(
        tf.cast(self._r, loss.dtype) * loss, xs,
        colocate_gradients_with_ops=colocate)
    n = len(paths)
    return [flat[r * n:(r + 1) * n] for r in range(self._r)]

  # Forward: what each replica reads.

  def ReplicaTheta(self, replica, theta, variables, device_fn, stage_fn):
    """The theta replica `replica` runs its tower with.

    Args:
      replica: r in [0, R).
      theta: The task's theta (replica 0's copy of every variable).
      variables: The task's variables (a NestedMap like theta).
      device_fn: path -> the device of replica r that reads that variable.
      stage_fn: path -> its pipeline stage (the collective group).

    Returns:
      A NestedMap like theta whose leaves are replica r's reads.
    """
    var_of = dict(variables.FlattenItems())
    if replica == 1 and not self._plans:
      self._Plan(var_of)

    def Read(path, value):
      if path not in var_of:
        return value  # Not a variable (extra theta); shared.
      self._masters[path] = var_of[path]
      self._stages[path] = stage_fn(path)
      device = device_fn(path)
      self._devices[replica][path] = device
      if replica > 0 and self._plans[path] == 'replicated':
        value = self._mirrors[(replica, path)]
        with tf.control_dependencies([self._copy_vars]):
          value = value.read_value()
      with tf.device(device):
        read = tf.identity(value, name='replica_read')
      self._reads[replica][path] = read
      return read

    return theta.TransformWithKey(Read)

  def _Plan(self, var_of):
    """Decides each variable's plan and creates the replicas' copies."""
    for path in var_of:
      self._plans[path] = self._PlanOf(path)
    graph = tf.get_default_graph()
    with graph.name_scope(None), tf.control_dependencies(None):
      with graph.colocate_with(None, ignore_existing=True):
        self._synced = tf.Variable(
            False, trainable=False, name=f'{self._name}/replicas_synced',
            collections=[tf.GraphKeys.LOCAL_VARIABLES], use_resource=True)
        copies = []
        for r in range(1, self._r):
          for path, var in var_of.items():
            if self._plans[path] != 'replicated':
              continue
            # The copy lives where replica r reads it (its stage's device).
            device = self._ReplicaDevice(r, path)
            with tf.device(device):
              mirror = tf.Variable(
                  tf.zeros(var.shape, var.dtype), trainable=False,
                  name=f'replica_{r}/{var.op.name}',
                  collections=[tf.GraphKeys.LOCAL_VARIABLES],
                  use_resource=True)
            self._mirrors[(r, path)] = mirror
            copies.append((mirror, var))
        # Replicas >= 1 start from replica 0's copy (fresh or restored).
        self._copy_vars = tf.cond(
            self._synced.read_value(), tf.no_op,
            lambda: tf.group(*[m.assign(v.read_value()) for m, v in copies]),
            name='copy_replica_vars')

  def _ReplicaDevice(self, r, path):
    """Replica r's device for `path`: replica 0's, shifted by r splits."""
    # Replica r's device of stage s is device r * K + s of the worker; the
    # task gives it to ReplicaTheta, but mirrors are made before replica r's
    # tower, so it is derived from the cluster here.
    with cluster_factory.SetModelSplit(r) as c:
      return c.WorkerDeviceInModelSplit(self._stages.get(path, 0))

  def MirrorVariables(self):
    """{(replica, path): local variable} of replicas >= 1 ('replicated')."""
    return dict(self._mirrors)

  def Plans(self):
    return dict(self._plans)

  # Backward: synchronised gradients and updates.

  def Apply(self, learner, metrics, vmap, gradient_mask=None,
            gradient_adjuster=None):
    """A SyncLearner's Apply: Learner.Apply's arguments and return values."""
    losses = learner.ComputeLosses(metrics)
    if len(losses) != 1:
      raise ValueError(
          f'{self._name}: gradient_sync supports one loss per learner, got '
          f'loss_name={learner.params.loss_name!r}.')
    loss = losses[0]
    vmap = learner.GetTrainableVariables(vmap)
    paths = [path for path, _ in vmap.FlattenItems()]
    grads = self._Gradients(loss, paths, vmap,
                            learner.params.colocate_gradients_with_ops)
    for x, g in zip(paths, grads[0]):
      if g is None:
        raise ValueError(f'{self._name}: variable {x} has no gradient.')
    var_of = dict(vmap.FlattenItems())
    synced = [{} for _ in grads]
    for i, path in enumerate(paths):
      pending = self._SyncVariable(path, [g[i] for g in grads], var_of[path])
      for r, p in enumerate(pending):
        synced[r][path] = p
    update, eval_metrics = self._Update(learner, var_of, paths, synced,
                                        gradient_mask, gradient_adjuster)
    return [loss], update, eval_metrics

  def _Accumulate(self, grads, var, device, force=False):
    """accumulation.Accumulate over accumulate_steps; records accumulators."""
    pending = accumulation.Accumulate(grads, var, device, self._n, force)
    if pending.acc is not None:
      self.accumulators.append((var, pending.acc))
    return pending

  def _Update(self, learner, var_of, paths, synced, gradient_mask,
              gradient_adjuster):
    """Clips and applies the synced gradients to every replica's copies.

    Returns:
      (the update op, the eval metrics of replica 0's clipping).
    """
    ready = None
    for pending in synced[0].values():
      if pending.acc is not None:
        ready = pending.ready
        break
    lr = learner.LearningRate()
    ops = []
    eval_metrics = None
    taken = {}  # id(Pending) -> gradient, so a ps take happens once.
    master_new_vars = []
    for r, grads in enumerate(synced):
      with tf.name_scope(f'replica_{r}_update'):
        var_grads = py_utils.NestedMap()
        for path in paths:
          pending = grads.get(path) or synced[0][path]
          if id(pending) not in taken:
            taken[id(pending)] = pending.Take()
          var = var_of[path]
          if r > 0 and self._plans.get(path) == 'replicated':
            var = self._mirrors[(r, path)]
          var_grads.Set(path, py_utils.VarGrad(var, taken[id(pending)]))
        adjusted, stats = learner.AdjustGradients(
            var_grads, gradient_mask=gradient_mask,
            gradient_adjuster=gradient_adjuster)
        if r == 0:
          # The learner keeps one metrics dict; later replicas overwrite it.
          eval_metrics = dict(stats)
          targets = adjusted
        else:
          # Replica r updates only its own copies; the shared ones are
          # replica 0's. The clipping above saw every gradient, as replica
          # 0's did.
          targets = adjusted.Filter(lambda vg: vg.var.op.name.startswith(
              'replica_'))
          if not targets.Flatten():
            continue
        ops.append(
            self._ApplyOptimizer(learner, lr, targets, r, ready,
                                 master_new_vars, ops[:1]))
    eval_metrics['learning_rate'] = (tf.convert_to_tensor(lr),
                                     tf.convert_to_tensor(1.))
    update = tf.group(*ops)
    if self._synced is not None:
      with tf.control_dependencies([update]):
        done = (tf.constant(True) if ready is None else ready)
        update = self._synced.assign(
            tf.logical_or(self._synced.read_value(), done)).op
    return update, eval_metrics

  def _ApplyOptimizer(self, learner, lr, var_grads, r, ready, master_new_vars,
                      master_ops):
    """Replica r's optimizer update (under `ready` when accumulating)."""

    def Apply():
      if r == 0 and ready is None:
        return learner.ApplyOptimizer(lr, var_grads)
      # Summaries cannot be made inside a cond (Lingvo's Accumulator turns
      # them off too); replica 0's are made when it updates unconditionally.
      with replica_state.NoSummaryInApply(learner.optimizer):
        return learner.ApplyOptimizer(lr, var_grads)

    # The recorders wrap the conds: optimizer slots are made in init_scope,
    # i.e. in the outer graph, whose variable creators are these.
    if r == 0:
      with replica_state.RecordNewVariables(master_new_vars, local=False):
        return Apply() if ready is None else tf.cond(ready, Apply, tf.no_op)

    new_vars = []

    def CopyFromMaster():
      # The first update after a start: replica 0's copies and optimizer
      # state were restored, this replica's optimizer state was not; take
      # replica 0's updated copies and state.
      with tf.control_dependencies(master_ops):
        assigns = []
        for vg in var_grads.Flatten():
          path = replica_state.PathOfMirror(self._mirrors, vg.var)
          assigns.append(vg.var.assign(self._masters[path].read_value()))
        for mine, theirs in replica_state.PairOptimizerVariables(
            r, new_vars, master_new_vars):
          assigns.append(mine.assign(theirs.read_value()))
        return tf.group(*assigns)

    def Update():
      return tf.cond(self._synced.read_value(), Apply, CopyFromMaster)

    with replica_state.RecordNewVariables(new_vars, local=True):
      if ready is None:
        return Update()
      return tf.cond(ready, Update, tf.no_op)
