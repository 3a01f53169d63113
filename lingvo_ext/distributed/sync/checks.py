"""The data-parallel task params' checks, and the names they accept."""

STRATEGIES = ('shared', 'all_reduce', 'parameter_server', 'hybrid')
COMPRESSIONS = ('none', 'fp16')
PS_PLACEMENTS = ('size', 'round_robin')


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
