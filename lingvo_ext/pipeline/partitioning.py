"""Exact min-max partitioning of a sequence of costs into contiguous groups.

A GPipe step is paced by its slowest cell, so a sequential stack is best cut
where the largest per-cell cost is the least possible. Lingvo's heuristic cuts
at the quantiles of the cumulative cost histogram, which can leave the slowest
cell 1.33x over the optimum on 24 equal layers cut in 8; this is exact.
"""

import math
from typing import List
from typing import Sequence


def _CheckArgs(costs: Sequence[float], num_partitions: int) -> List[float]:
  if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
    raise ValueError('num_partitions must be an int, got %r.' %
                     (num_partitions,))
  if num_partitions < 1:
    raise ValueError('num_partitions must be >= 1, got %d.' % num_partitions)
  costs = list(costs)
  if num_partitions > len(costs):
    raise ValueError(
        'num_partitions=%d is more than the %d items to partition; every '
        'partition must be non-empty, so use num_partitions <= %d.' %
        (num_partitions, len(costs), len(costs)))
  for i, c in enumerate(costs):
    if not isinstance(c, (int, float)) or isinstance(c, bool):
      try:
        c = float(c)  # numpy scalars.
      except (TypeError, ValueError):
        raise ValueError('costs[%d]=%r is not a number.' % (i, c)) from None
      costs[i] = c
    if math.isnan(c) or c < 0 or math.isinf(c):
      raise ValueError('costs[%d]=%r; costs must be finite and >= 0.' % (i, c))
  return costs


def _Prefix(costs: Sequence[float]) -> List[float]:
  prefix = [0]
  for c in costs:
    prefix.append(prefix[-1] + c)
  return prefix


def _NumGroupsNeeded(prefix: Sequence[float], bound: float) -> int:
  """Fewest contiguous groups with every group's cost <= bound (greedy)."""
  n = len(prefix) - 1
  groups, start = 0, 0
  while start < n:
    end = start + 1
    if prefix[end] - prefix[start] > bound:
      return n + 1  # A single item exceeds the bound: infeasible.
    while end < n and prefix[end + 1] - prefix[start] <= bound:
      end += 1
    groups += 1
    start = end
  return groups


def _OptimalBound(prefix: Sequence[float], num_partitions: int) -> float:
  """The least possible largest group cost, given the prefix sums."""
  n = len(prefix) - 1
  # The optimum is the cost of some contiguous run, so bisect over the sorted
  # set of all run costs with a greedy feasibility probe: exact, no tolerance.
  # Costs are computed as prefix differences here and in the probe alike.
  candidates = sorted({prefix[j] - prefix[i]
                       for i in range(n) for j in range(i + 1, n + 1)})
  lo, hi = 0, len(candidates) - 1  # candidates[-1] (the total) is feasible.
  while lo < hi:
    mid = (lo + hi) // 2
    if _NumGroupsNeeded(prefix, candidates[mid]) <= num_partitions:
      hi = mid
    else:
      lo = mid + 1
  return candidates[lo]


def MinMaxBottleneck(costs: Sequence[float], num_partitions: int) -> float:
  """The least possible largest group cost over all valid partitions."""
  return _OptimalBound(_Prefix(_CheckArgs(costs, num_partitions)),
                       num_partitions)


def MinMaxPartition(costs: Sequence[float], num_partitions: int) -> List[int]:
  """Sizes of contiguous groups whose largest total cost is the least possible.

  Args:
    costs: Non-negative cost of each item, in order.
    num_partitions: Number of groups, 1 <= num_partitions <= len(costs).

  Returns:
    A list of `num_partitions` positive ints summing to len(costs). Among the
    optimal partitions, ties are broken deterministically: each group, from
    the first, takes as many items as fit under the optimal bottleneck while
    leaving at least one item for every later group.

  Raises:
    ValueError: num_partitions < 1, more partitions than items, or a cost that
      is negative or not finite.
  """
  costs = _CheckArgs(costs, num_partitions)
  prefix = _Prefix(costs)
  bound = _OptimalBound(prefix, num_partitions)
  n = len(costs)
  sizes, start = [], 0
  for k in range(num_partitions):
    last = n - (num_partitions - k - 1)  # Leaves one item per later group.
    end = start + 1
    while end < last and prefix[end + 1] - prefix[start] <= bound:
      end += 1
    sizes.append(end - start)
    start = end
  # Every item must be placed; the greedy reaches at least as far as any
  # optimal partition, so this holds by construction.
  assert start == n, (sizes, n)
  return sizes


def Bottleneck(costs: Sequence[float], sizes: Sequence[int]) -> float:
  """Largest group cost when `costs` is cut into groups of `sizes`."""
  if sum(sizes) != len(costs) or any(s < 1 for s in sizes):
    raise ValueError('sizes=%s must be positive and sum to len(costs)=%d.' %
                     (list(sizes), len(costs)))
  out, start = 0, 0
  for s in sizes:
    out = max(out, sum(costs[start:start + s]))
    start += s
  return out
