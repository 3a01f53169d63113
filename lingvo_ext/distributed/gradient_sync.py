"""Gradient synchronisation of data-parallel replicas (AutoDist's strategies).

A task with R data-parallel replicas (Lingvo's splits: R = num_cpu_devices /
worker_split_size per worker, times the worker replicas) builds one graph in
which replica r runs the whole (pipelined) model on its own devices. How the
replicas' gradients meet is the strategy, `PipelinedTask.gradient_sync`:

- 'shared': Lingvo's behaviour. One copy of each variable that every replica
  reads; tf.gradients sums the replicas' gradients at the variable.
- 'all_reduce': every replica keeps its own copy of each variable on its own
  devices (replica 0's copy is the variable of the checkpoint, under the
  original name; the others are local variables, copied from it when a
  trainer starts). Dense gradients are all-reduced with TensorFlow's
  CollectiveReduceV2 (sum, then divide by R), sparse ones (tf.IndexedSlices)
  all-gathered, indices and values, with CollectiveGatherV2, never densified.
  Every replica applies the same update to its copy.
- 'parameter_server': one copy, on a ps device; every replica's gradient goes
  into a ConditionalAccumulator (dense) or SparseConditionalAccumulator
  (sparse) on that device, and the variable is updated once all R gradients
  have arrived.
- 'hybrid': dense variables by 'all_reduce', sparse ones (read only by
  gathers, e.g. embedding tables) by 'parameter_server'.

`accumulate_steps` = N > 1 (any strategy) applies one update every N steps
from the mean of the N steps' gradients, using the same TensorFlow
accumulators, so it equals one step of an N-times larger batch, sparse
gradients included. Gradients are clipped after accumulation, like those of
the large batch. (Lingvo's optimizer.Accumulator clips each step's gradient
before it accumulates, and densifies IndexedSlices, so it is not used.)

Each replica's gradient is that of R times the global loss with respect to
its own copy (or its own read of the shared copy). The global loss is
Lingvo's weighted mean over replicas, so the mean of these R gradients is the
gradient of one replica training on the whole global batch.
"""

import contextlib
import dataclasses
import re
import threading

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import learner as lingvo_learner
from lingvo.core import py_utils
import numpy as np

from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.distributed import accumulation
from lingvo_ext.distributed import collectives

# Kept where callers found them.
StableKey = collectives.StableKey
AllReduceMean = collectives.AllReduceMean
AllGatherSlices = collectives.AllGatherSlices

STRATEGIES = ('shared', 'all_reduce', 'parameter_server', 'hybrid')
COMPRESSIONS = ('none', 'fp16')
PS_PLACEMENTS = ('size', 'round_robin')

# Collective groups: one per pipeline stage (its members are the R replicas'
# devices of that stage); keys above this base.
_GROUP_KEY_BASE = 1000


def CheckParams(name: str, gradient_sync: str, accumulate_steps: int,
                gradient_compression: str, ps_placement: str) -> None:
  """Raises ValueError for a bad value of a data-parallel task param."""
  if gradient_sync not in STRATEGIES:
    raise ValueError(
        f'{name}: gradient_sync={gradient_sync!r} is not a strategy; set '
        f'task.gradient_sync to one of {", ".join(STRATEGIES)}.')
  if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
    raise ValueError(
        f'{name}: accumulate_steps={accumulate_steps!r} must be an integer '
        '>= 1; set task.accumulate_steps to 1 for one update per step, or N '
        'for one update every N steps.')
  if gradient_compression not in COMPRESSIONS:
    raise ValueError(
        f'{name}: gradient_compression={gradient_compression!r}; set '
        f'task.gradient_compression to one of {", ".join(COMPRESSIONS)}.')
  if ps_placement not in PS_PLACEMENTS:
    raise ValueError(
        f'{name}: ps_placement={ps_placement!r}; set task.ps_placement to '
        f'one of {", ".join(PS_PLACEMENTS)}.')


def CheckReplicas(name: str, gradient_sync: str, num_replicas: int,
                  devices_per_replica: int, batch_size: int,
                  num_micro_batches: int) -> None:
  """Raises ValueError if the replicas cannot run `gradient_sync`.

  Args:
    name: The task's name, for messages.
    gradient_sync: The strategy.
    num_replicas: R, the number of data-parallel replicas (splits).
    devices_per_replica: Devices of one replica (the worker split size).
    batch_size: The input's batch_size, per replica.
    num_micro_batches: Micro-batches of the pipeline.
  """
  if gradient_sync == 'all_reduce' and num_replicas < 2:
    k = devices_per_replica
    raise ValueError(
        f'{name}: gradient_sync="all_reduce" needs at least 2 data-parallel '
        f'replicas but there is {num_replicas}. Give the worker twice the '
        f'devices of one replica (--num_cpu_devices={2 * k} '
        f'--worker_split_size={k}), or more worker replicas, or set '
        'task.gradient_sync to "shared".')
  if batch_size % num_micro_batches:
    raise ValueError(
        f'{name}: the global batch {batch_size * num_replicas} '
        f'(input.batch_size={batch_size} per replica x {num_replicas} '
        f'replicas) is not divisible by replicas x micro-batches = '
        f'{num_replicas} x {num_micro_batches}; set task.input.batch_size '
        f'to a multiple of num_micro_batches={num_micro_batches}.')


def _NumBytes(shape, dtype):
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
  """

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
    self._keys = {}
    self.stats = CommunicationStats()
    self.accumulators = []  # For graph checks: (variable, accumulator).

  @property
  def num_replicas(self):
    return self._r

  def _InstanceKey(self, text):
    """A key derived from `text`; unique among this graph's keys."""
    if text not in self._keys:
      key = StableKey(text)
      used = set(self._keys.values())
      while any(k in used for k in range(key, key + 3)):
        key += 3  # Each collective may use key, key + 1 and key + 2.
      self._keys[text] = key
    return self._keys[text]

  def _GroupKey(self, stage):
    return _GROUP_KEY_BASE + stage

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
      if self._strategy == 'all_reduce':
        plan = 'replicated'
      elif self._strategy == 'parameter_server':
        plan = 'ps'
      else:  # hybrid: variables read only by gathers get sparse gradients.
        plan = 'ps' if _ReadOnlyByGathers(self._reads[0][path]) else (
            'replicated')
      self._plans[path] = plan
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
    from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
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
    p = learner.params
    if self._strategy == 'shared':
      xs = [[v for _, v in vmap.FlattenItems()]]
      grads = tf.gradients(
          loss, xs[0], colocate_gradients_with_ops=p.colocate_gradients_with_ops)
      grads = [grads]
    else:
      missing = [x for x in paths if x not in self._reads[0]]
      if missing:
        raise ValueError(f'{self._name}: variables {missing} were not read '
                         'through ReplicaTheta.')
      if not self._plans:  # One replica: planned here, not at replica 1.
        self._Plan(dict(self._masters))
      xs = [self._reads[r][x] for r in range(self._r) for x in paths]
      flat = tf.gradients(
          tf.cast(self._r, loss.dtype) * loss, xs,
          colocate_gradients_with_ops=p.colocate_gradients_with_ops)
      n = len(paths)
      grads = [flat[r * n:(r + 1) * n] for r in range(self._r)]
    for x, g in zip(paths, grads[0]):
      if g is None:
        raise ValueError(f'{self._name}: variable {x} has no gradient.')
    var_of = dict(vmap.FlattenItems())
    synced = self._SyncGradients(paths, grads, var_of)
    update, eval_metrics = self._Update(learner, var_of, paths, synced,
                                        gradient_mask, gradient_adjuster)
    return [loss], update, eval_metrics

  def _SyncGradients(self, paths, grads, var_of):
    """Per replica, per path: the gradient, or an accumulator to take from.

    Returns:
      A list over replicas (1 for 'shared') of {path: accumulation.Pending}.
    """
    num_targets = 1 if self._strategy == 'shared' else self._r
    out = [{} for _ in range(num_targets)]
    for i, path in enumerate(paths):
      var = var_of[path]
      plan = 'shared' if self._strategy == 'shared' else self._plans[path]
      if plan == 'shared':
        out[0][path] = self._Accumulate([grads[0][i]], var,
                                        grads[0][i].device)
        continue
      per_replica = [grads[r][i] for r in range(self._r)]
      if plan == 'ps':
        g0 = per_replica[0]
        if isinstance(g0, tf.IndexedSlices):
          self.stats.ps_push_bytes += (
              _NumBytes(g0.values.shape, g0.values.dtype) +
              _NumBytes(g0.indices.shape, tf.int64))
        else:
          self.stats.ps_push_bytes += _NumBytes(g0.shape, g0.dtype)
        # AutoDist's PS synchroniser: the accumulator lives with the
        # variable and releases one mean once all R gradients arrived.
        pending = self._Accumulate(per_replica, var, var.device, force=True)
        for r in range(self._r):
          out[r][path] = pending
        continue
      devices = [self._devices[r][path] for r in range(self._r)]
      group = self._GroupKey(self._stages[path])
      key = self._InstanceKey(var.op.name)
      with tf.name_scope('all_reduce'):
        if isinstance(per_replica[0], tf.IndexedSlices):
          g0 = per_replica[0]
          self.stats.sparse_all_gather_bytes += (
              _NumBytes(g0.values.shape, g0.values.dtype) +
              _NumBytes(g0.indices.shape, tf.int64))
          self.stats.sparse_densified_bytes += _NumBytes(var.shape, var.dtype)
          reduced = AllGatherSlices(per_replica, devices, group, key)
        else:
          size = _NumBytes(per_replica[0].shape, per_replica[0].dtype)
          if self._compression == 'fp16':
            size //= 2
          self.stats.dense_all_reduce_bytes += size
          reduced = AllReduceMean(per_replica, devices, group, key,
                                  self._compression)
      for r in range(self._r):
        with tf.device(devices[r]):
          out[r][path] = self._Accumulate([reduced[r]], var, devices[r])
    return out

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
      with _NoSummaryInApply(learner.optimizer):
        return learner.ApplyOptimizer(lr, var_grads)

    # The recorders wrap the conds: optimizer slots are made in init_scope,
    # i.e. in the outer graph, whose variable creators are these.
    if r == 0:
      with _RecordNewVariables(master_new_vars, local=False):
        return Apply() if ready is None else tf.cond(ready, Apply, tf.no_op)

    new_vars = []

    def CopyFromMaster():
      # The first update after a start: replica 0's copies and optimizer
      # state were restored, this replica's optimizer state was not; take
      # replica 0's updated copies and state.
      with tf.control_dependencies(master_ops):
        assigns = []
        for vg in var_grads.Flatten():
          master = self._masters[_PathOfMirror(self._mirrors, vg.var)]
          assigns.append(vg.var.assign(master.read_value()))
        for mine, theirs in _PairOptimizerVariables(r, new_vars,
                                                    master_new_vars):
          assigns.append(mine.assign(theirs.read_value()))
        return tf.group(*assigns)

    def Update():
      return tf.cond(self._synced.read_value(), Apply, CopyFromMaster)

    with _RecordNewVariables(new_vars, local=True):
      if ready is None:
        return Update()
      return tf.cond(ready, Update, tf.no_op)


def _PairOptimizerVariables(r, mine, masters):
  """Pairs replica r's optimizer variables with replica 0's.

  Slots are matched by name (replica r's are named after its copies,
  'replica_r/<name>/...'). The rest (e.g. Adam's beta1_power, beta2_power)
  by their own name, less the scopes and the '_N' TensorFlow adds to a
  repeated name, and shape; only where that is ambiguous, in creation order
  among those of the same shape.
  """
  by_name = {v.op.name: v for v in masters}
  pairs, rest = [], []
  used = set()
  prefix = f'replica_{r}/'
  for v in mine:
    name = v.op.name
    if name.startswith(prefix) and name[len(prefix):] in by_name:
      theirs = by_name[name[len(prefix):]]
      pairs.append((v, theirs))
      used.add(id(theirs))
    else:
      rest.append(v)
  others = [v for v in masters if id(v) not in used]
  for v in rest:
    same = [m for m in others if m.shape == v.shape]
    named = [m for m in same if _BaseName(m) == _BaseName(v)]
    match = named[0] if len(named) == 1 else next(iter(same), None)
    if match is None:
      raise ValueError(
          f'replica {r}\'s optimizer variable {v.name} has no counterpart '
          f'among replica 0\'s {[m.name for m in masters]}.')
    others.remove(match)
    pairs.append((v, match))
  return pairs


def _BaseName(v):
  """'beta1_power' of '.../beta1_power_1': the name a variable was given."""
  return re.sub(r'_\d+$', '', v.op.name.rsplit('/', 1)[-1])


@contextlib.contextmanager
def _NoSummaryInApply(opt):
  p = opt.params
  saved = p.add_summary_in_apply
  p.add_summary_in_apply = False
  try:
    yield
  finally:
    p.add_summary_in_apply = saved


def _PathOfMirror(mirrors, var):
  for (_, path), m in mirrors.items():
    if m is var:
      return path
  raise KeyError(var.name)


class _RecordNewVariables:
  """Records the variables created inside; `local` makes them local ones."""

  def __init__(self, into, local):
    self._into = into
    self._local = local
    self._scope = None

  def _Creator(self, next_creator, **kwargs):
    if self._local:
      kwargs['collections'] = [tf.GraphKeys.LOCAL_VARIABLES]
    v = next_creator(**kwargs)
    self._into.append(v)
    return v

  def __enter__(self):
    self._scope = tf.variable_creator_scope(self._Creator)
    self._scope.__enter__()

  def __exit__(self, *args):
    return self._scope.__exit__(*args)


def _ReadOnlyByGathers(read):
  """Whether every use of `read` (through identities) is a gather's params.

  Followed into function calls (a pipeline cell built once): a gather there
  exports its rows' gradient, which stays sparse.
  """
  frontier = [read]
  seen = False
  while frontier:
    t = frontier.pop()
    for op in t.consumers():
      if op.type in ('Identity', 'StopGradient'):
        frontier.extend(op.outputs)
      elif op.type == 'IdentityN':  # E.g. a tf.custom_gradient's inputs.
        frontier.extend(
            out for inp, out in zip(op.inputs, op.outputs) if inp is t)
      elif op.type in ('PartitionedCall', 'StatefulPartitionedCall'):
        body = internal_tf.FunctionGraph(op)
        if body is None:
          return False
        frontier.extend(arg for inp, arg in zip(op.inputs, body.inputs)
                        if inp is t)
      elif op.type in ('GatherV2', 'Gather', 'ResourceGather') and (
          op.inputs[0] is t):
        seen = True
      else:
        return False
  return seen


# --- The learners' hook ----------------------------------------------------------

_ACTIVE = threading.local()


def _Stack():
  if not hasattr(_ACTIVE, 'stack'):
    _ACTIVE.stack = []
  return _ACTIVE.stack


@contextlib.contextmanager
def Applying(sync):
  """SyncLearners' Apply built inside goes through `sync` (a GradientSync)."""
  _Stack().append(sync)
  try:
    yield sync
  finally:
    _Stack().pop()


def _SumDuplicateRows(var_grad):
  """var_grad with a tf.IndexedSlices gradient's repeated rows summed."""
  var, grad = var_grad.var, var_grad.grad
  if not isinstance(grad, tf.IndexedSlices):
    return var_grad
  with tf.device(grad.values.device), tf.name_scope('sum_duplicate_rows'):
    rows, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position,
                                          tf.size(rows))
  return py_utils.VarGrad(var, tf.IndexedSlices(values, rows,
                                                grad.dense_shape),
                          var_grad.scale)


class SyncLearnerMixin:
  """A Learner whose Apply is the active GradientSync's (see Applying).

  Outside `Applying` (evalers, the controller of a cluster, a task without
  a sync) it is the Learner's own Apply. Either way it clips by the norm of
  the gradients with a sparse gradient's repeated rows summed
  (ScaleGradients); every PipelinedTask's learners are of this kind.
  """

  def Apply(self, metrics, vmap, gradient_mask=None, gradient_adjuster=None):
    stack = _Stack()
    if not stack:
      return super().Apply(metrics, vmap, gradient_mask=gradient_mask,
                           gradient_adjuster=gradient_adjuster)
    return stack[-1].Apply(self, metrics, vmap, gradient_mask,
                           gradient_adjuster)

  def ScaleGradients(self, var_grads, gradient_adjuster=None):
    """Lingvo's clipping, by the global norm of the gradients themselves.

    Lingvo's norm sums the squares of a tf.IndexedSlices' rows, so a row
    looked up twice in a batch counts twice; 'recurrent' hands over a
    lookup's gradient dense, the other schedules sparse, so their norms
    (and their clipping) would differ.
    Duplicate rows are summed first (as the optimizer would), so every
    schedule, replica layout and the unpipelined model clip alike.
    """
    return super().ScaleGradients(var_grads.Transform(_SumDuplicateRows),
                                  gradient_adjuster=gradient_adjuster)

  def ApplyOptimizer(self, lr, var_grads):
    """The optimizer's update of var_grads, in the learner's variable scope."""
    with self._SelfVariableScope():
      return tf.group(self.optimizer.Apply(lr, var_grads))


class SyncLearner(SyncLearnerMixin, lingvo_learner.Learner):
  """lingvo.core.learner.Learner through the active GradientSync."""


_SYNC_CLASSES = {lingvo_learner.Learner: SyncLearner}


def _SyncClass(cls):
  if issubclass(cls, SyncLearnerMixin):
    return cls
  if cls not in _SYNC_CLASSES:  # A user's Learner subclass.
    _SYNC_CLASSES[cls] = type(f'Sync{cls.__name__}', (SyncLearnerMixin, cls),
                              {'__module__': __name__})
  return _SYNC_CLASSES[cls]


def WithSyncLearners(task_params):
  """A copy of task_params whose learners apply through GradientSync.

  Legacy learner params (train.learning_rate, optimizer...) become one
  SyncLearner, as Lingvo's BaseTask would make a Learner of them.
  """
  p = task_params.Copy()
  tp = p.train
  if tp.learner is None:
    tp.learner = lingvo_learner.ExtractLearnerFromLegacyParams(
        tp, cls=SyncLearner)
  elif isinstance(tp.learner, (list, tuple)):
    for lp in tp.learner:
      lp.cls = _SyncClass(lp.cls)
  else:
    tp.learner.cls = _SyncClass(tp.learner.cls)
  return p
