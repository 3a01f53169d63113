"""Partitioned (sharded) layer variables, made by TensorFlow's partitioners.

A layer param `partitioner` picks one of TensorFlow's partitioners by name,
with that partitioner's own keyword arguments:

  None                                         one variable (no partitioning)
  ('fixed_size', dict(num_shards=4))           tf.compat.v1.fixed_size_partitioner
  ('min_max', dict(max_partitions=8,           tf.compat.v1.min_max_variable_partitioner
               min_slice_size=256 << 10))
  ('variable_axis_size',                       tf.compat.v1.variable_axis_size_partitioner
   dict(max_shard_bytes=64 << 20))

The layer picks the axis (the vocabulary axis), so `axis` is not an
argument. `tf.compat.v1.get_variable(..., partitioner=...)` makes the shards
(`<name>/var/part_<i>`), each a variable carrying TF's save-slice info, so a
`tf.compat.v1.train.Saver` writes one tensor `<name>/var` in slices and a
checkpoint restores into any other number of shards (or none). Optimizer
slots (Adam's m and v, Adagrad's accumulator) get the same slice info from TF's
slot creator and re-partition too.

Placement rule: shard i goes to device i mod n of
  - the devices of the ps job of Lingvo's cluster, when it has more than one:
    its tasks (`/job:ps/replica:0/task:<j>`) in a multi-process run, or, in
    one process, the --num_cpu_devices CPUs that lingvo_ext.trainer gives
    every job; else
  - the devices of the first model split of the workers
    (`cluster.params.worker.devices_per_split` of them, e.g. a
    `cluster_factory.ForTestingWorker(cpus=N, split_size=N)`).
  With one device, the shards are left to the surrounding placement.
The rule reads only the cluster's ps and worker specs, so every job of a run
(controller, trainer, evaler) places a shard on the same device.

Shards are ordinary variables of the layer: `layer.vars.<name>` and
`theta.<name>` are the list of shards, so the optimizer sees each shard, and a
gather from a shard gives it a `tf.IndexedSlices` gradient.
"""

import re
from typing import Any
from typing import Callable
from typing import List
from typing import Optional

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils

from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext._internal import tf as internal_tf

PARTITIONERS = {
    'fixed_size': (tf.compat.v1.fixed_size_partitioner, ('num_shards',),
                   ('num_shards',)),
    'min_max': (tf.compat.v1.min_max_variable_partitioner,
                ('max_partitions', 'min_slice_size',
                 'bytes_per_string_element'), ()),
    'variable_axis_size': (tf.compat.v1.variable_axis_size_partitioner,
                           ('max_shard_bytes', 'bytes_per_string_element',
                            'max_shards'), ('max_shard_bytes',)),
}
PARTITION_STRATEGIES = ('div', 'mod')

_PART_RE = re.compile(r'/var/part_(\d+)(/|$)')


def _Where(p, name):
  return '%s: %s.%s' % (p.name, p.cls.__name__, name)


def CheckPartitionStrategy(p) -> None:
  """Raises ValueError unless p.partition_strategy is 'div' or 'mod'."""
  if p.partition_strategy not in PARTITION_STRATEGIES:
    raise ValueError(
        '%s=%r: the layer serves only the partition strategies of '
        'tf.nn.embedding_lookup; set it to one of %s.' %
        (_Where(p, 'partition_strategy'), p.partition_strategy,
         ', '.join(repr(s) for s in PARTITION_STRATEGIES)))


def MakePartitioner(p, axis: int = 0) -> Optional[Callable[..., Any]]:
  """The TF partitioner that p.partitioner names, or None.

  Args:
    p: A layer's params with `partitioner` (see the module docstring).
    axis: The axis the layer partitions.

  Returns:
    A partitioner for `tf.compat.v1.get_variable`, or None.

  Raises:
    ValueError: naming p.partitioner, when its name or arguments are unknown
      or its values are rejected by TensorFlow.
  """
  spec = p.partitioner
  if spec is None:
    return None
  where = _Where(p, 'partitioner')
  if (not isinstance(spec, (tuple, list)) or len(spec) != 2 or
      not isinstance(spec[0], str) or not isinstance(spec[1], dict)):
    raise ValueError(
        '%s=%r: give None or (name, dict of arguments), e.g. '
        "('fixed_size', dict(num_shards=4)); names: %s." %
        (where, spec, ', '.join(sorted(PARTITIONERS))))
  name, kwargs = spec
  if name not in PARTITIONERS:
    raise ValueError('%s=%r: unknown partitioner %r; use one of %s.' %
                     (where, spec, name, ', '.join(sorted(PARTITIONERS))))
  fn, allowed, required = PARTITIONERS[name]
  unknown = sorted(set(kwargs) - set(allowed))
  if unknown:
    raise ValueError(
        '%s=%r: unknown argument(s) %s for %r; it takes %s (the layer picks '
        'the axis).' % (where, spec, ', '.join(unknown), name,
                        ', '.join(allowed)))
  missing = [k for k in required if k not in kwargs]
  if missing:
    raise ValueError('%s=%r: %r needs %s.' %
                     (where, spec, name, ', '.join(missing)))
  for k, v in kwargs.items():
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or
                          v < 1):
      raise ValueError('%s=%r: %s=%r must be a positive int.' %
                       (where, spec, k, v))
  try:
    return fn(axis=axis, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError('%s=%r: %s' % (where, spec, e)) from e


def NumShards(p, shape, dtype, axis: int = 0) -> int:
  """How many shards p.partitioner cuts a variable of `shape` into.

  Raises:
    ValueError: naming p.partitioner when it asks for more shards than the
      partitioned axis has rows.
  """
  partitioner = MakePartitioner(p, axis)
  if partitioner is None:
    return 1
  parts = partitioner(shape=tf.TensorShape(shape), dtype=tf.as_dtype(dtype))
  n = int(parts[axis])
  if p.partitioner[0] == 'fixed_size':
    n = p.partitioner[1]['num_shards']  # TF would quietly use fewer.
  if n > shape[axis]:
    raise ValueError(
        '%s=%r asks for %d shards of a variable with only %d rows along '
        'axis %d (shape %s); use at most %d shards.' %
        (_Where(p, 'partitioner'), p.partitioner, n, shape[axis], axis,
         list(shape), shape[axis]))
  return n


def ShardSizes(rows: int, num_shards: int) -> List[int]:
  """Rows per shard as TF's partitioned variables cut them (first ones +1)."""
  base, extra = divmod(rows, num_shards)
  return [base + (1 if i < extra else 0) for i in range(num_shards)]


def ShardDevices(num_shards: int, cluster=None) -> List[str]:
  """The device of each shard, by the rule in the module docstring."""
  cluster = cluster or cluster_factory.Current()
  cp = cluster.params
  # Both lists are the same for every job of a run (controller, trainer...),
  # which share the variables.
  devices = cluster.ListDevices(cp.ps).flatten().tolist()
  if len(devices) <= 1:
    split = max(1, cp.worker.devices_per_split)
    devices = cluster.ListDevices(cp.worker)[0].flatten().tolist()[:split]
  if len(devices) == 1:
    devices = ['']  # One device: leave placement to the surrounding scope.
  return [devices[i % len(devices)] for i in range(num_shards)]


def ShardInfo(p, var_name: str, shape, dtype, axis: int = 0,
              cluster=None) -> List[py_utils.NestedMap]:
  """Per-shard shape, bytes and device of a variable, without building it.

  Args:
    p: The layer's params (with `partitioner`).
    var_name: The variable's name in the layer (e.g. 'emb').
    shape: The full shape.
    dtype: The variable's dtype.
    axis: The partitioned axis.
    cluster: Lingvo cluster (default: the current one).

  Returns:
    One NestedMap(var, shard, shape, bytes, device) per shard.
  """
  dtype = tf.as_dtype(dtype)
  n = NumShards(p, shape, dtype, axis)
  devices = ShardDevices(n, cluster)
  out = []
  for i, rows in enumerate(ShardSizes(shape[axis], n)):
    s = list(shape)
    s[axis] = rows
    num = 1
    for d in s:
      num *= d
    out.append(
        py_utils.NestedMap(
            var=var_name, shard=i, shape=s, bytes=num * dtype.size,
            device=devices[i]))
  return out


def _SliceInitializer(init, full_shape):
  """Wraps `init` to give each shard its slice of the full initial value.

  The full value is drawn with the full shape (so fan-in/out and, with
  stateless initialization, the values equal those of the unpartitioned
  variable) and sliced at the shard's offset.
  """

  def Init(shape, dtype=None, partition_info=None):
    full = init(list(full_shape), dtype=dtype)
    if partition_info is None:
      return full
    offset = partition_info.var_offset
    return tf.slice(full, offset, shape)

  return Init


def _ShardDeviceFunction(devices):
  """Places the ops of shard i (ops under '.../var/part_<i>') on devices[i]."""

  def DeviceFn(op):
    m = _PART_RE.search(op.name)
    if m and devices[int(m.group(1))]:
      return devices[int(m.group(1))]
    return op.device

  return DeviceFn


def CreatePartitionedVariable(layer, name: str, var_params, axis: int = 0,
                              spec=None):
  """Creates layer variable `name`, partitioned by layer.params.partitioner.

  Goes through `layer.CreateVariable` (Lingvo's initializers, seeds and
  variable scopes), swapping in `tf.compat.v1.get_variable` with the TF
  partitioner and the placement rule. `layer.vars[name]` and
  `layer.theta[name]` become the list of shards. Without a partitioner this
  is `layer.CreateVariable(name, var_params)`.

  Args:
    layer: The layer, inside its `_CreateLayerVariables`.
    name: The variable's name in the layer.
    var_params: `py_utils.WeightParams` of the full variable.
    axis: The axis to partition.
    spec: Params whose `partitioner` to use (default: layer.params).

  Returns:
    The list of shards (or [variable] without a partitioner).
  """
  p = spec or layer.params
  partitioner = MakePartitioner(p, axis)
  if partitioner is None:
    layer.CreateVariable(name, var_params)
    return [layer.vars[name]]
  shape = list(var_params.shape)
  n = NumShards(p, shape, var_params.dtype, axis)
  devices = ShardDevices(n, layer.cluster)

  def Creator(next_creator, **kwargs):
    # In place of Lingvo's creator chain, which expects a single variable:
    # its variable scopes (absolute var_name, resource variables), then
    # tf.compat.v1.get_variable with the partitioner.
    del next_creator
    var_name = kwargs.pop('var_name')
    kwargs.pop('var_params')
    kwargs['initializer'] = _SliceInitializer(kwargs['initializer'],
                                              kwargs['shape'])
    scope = tf.get_variable_scope()
    root = tf.VariableScope(
        scope.reuse,
        custom_getter=scope.custom_getter,
        caching_device=scope.caching_device,
        use_resource=True)
    with tf.variable_scope(root), tf.variable_scope(var_name):
      with tf.device(_ShardDeviceFunction(devices)):
        return tf.compat.v1.get_variable(partitioner=partitioner, **kwargs)

  with py_utils.VariableCreatorScope(Creator), \
      py_utils.DisableVariableNameChecking():
    layer.CreateVariable(name, var_params)
  shards = list(internal_lingvo.PrivateVars(layer)[name])
  if len(shards) != n:
    raise AssertionError('expected %d shards of %s, got %d' %
                         (n, name, len(shards)))
  internal_lingvo.PrivateVars(layer)[name] = shards
  internal_lingvo.PrivateTheta(layer)[name] = list(shards)
  return shards


def IsShard(v) -> bool:
  """Whether v is one shard of a partitioned variable."""
  return internal_tf.SaveSliceInfo(v) is not None

