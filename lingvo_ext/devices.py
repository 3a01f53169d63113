"""Device arithmetic in one place: a process's devices as model splits.

Lingvo runs one copy of the model per split of `worker_split_size` devices
(`--worker_split_size`); the copies are data-parallel replicas. The trainer,
the pre-flight checks and the memory model count them here.
"""


def Replicas(num_devices: int, split_size: int) -> int:
  """The model's data-parallel copies on `num_devices` devices of splits of
  `split_size` devices each (at least one)."""
  return max(1, num_devices // max(1, split_size))
