"""The device arithmetic (lingvo_ext/devices.py)."""

from lingvo_ext import devices


def test_replicas_are_whole_splits_and_at_least_one():
  assert devices.Replicas(8, 2) == 4
  assert devices.Replicas(8, 3) == 2
  assert devices.Replicas(2, 2) == 1
  assert devices.Replicas(1, 2) == 1  # Fewer devices than a split: one copy.
  assert devices.Replicas(4, 0) == 4  # An unset split is one device.
