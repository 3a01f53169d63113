"""Memory: the planner's estimate against what the machine (or cgroup) has.

With --plan=auto the planner has predicted the chosen plan's memory
(parameters, optimizer slots, the activations its schedule and recompute
keep, the graph and the process's own); before the model is built, the
trainer compares it with the memory this process may use (its cgroup's
limit, else MemAvailable) and, when it does not fit, warns in one line with
the override of the fastest plan that does (more micro-batches, recompute, a
schedule that keeps fewer activations), or says that none does. Without
--plan=auto, the trainer estimates the plan its params give
(start_memory.py); a local run's controller also compares the built graph's
variables (parameters, optimizer slots) with it, before a session allocates
them.
"""

from typing import Optional
from typing import Tuple

from lingvo_ext.distributed import task_health


def AvailableBytes() -> Tuple[Optional[int], str]:
  """(bytes this process may use, where that figure comes from)."""
  return task_health.AvailableBytes()


def PlanWarning(needed: float, devices: int, available: Optional[float],
                source: str, fit: Optional[str]) -> Optional[str]:
  """The one warning line when `needed` bytes exceed `available`, or None.

  Args:
    needed: The process's predicted bytes (all its devices).
    devices: The devices it plans for (per-device figure in the line).
    available: What the process may use (AvailableBytes), or None.
    source: Where `available` comes from.
    fit: The override (and flags) of a plan that fits, or None if none does.
  """
  if available is None or needed <= available:
    return None
  size = task_health.FormatBytes
  line = (f'warning: the plan needs about {size(needed)} '
          f'({size(needed / max(1, devices))} per device, {devices} '
          f'device(s)) but {source} is {size(available)}: it may be killed '
          'by the OOM killer; ')
  if fit:
    return line + f'a plan that fits: {fit}.'
  return line + ('no plan fits; use more memory, more devices (--devices) '
                 'or bf16 (task.fprop_dtype).')


def CheckAutoPlan(plan, devices: int, replan, available=None,
                  source: str = '') -> Optional[str]:
  """--plan=auto: the warning line for the chosen `plan`, or None.

  Args:
    plan: The planner's chosen Candidate, or [(pipeline, Candidate)] for an
      experiment whose pipelines come cut.
    devices: --devices.
    replan: Called with a per-device budget in bytes; returns the
      (override text, trainer flags dict) of the fastest plan within it, or
      raises ValueError when none fits.
    available: The bytes the process may use (tests pass a value); None:
      AvailableBytes().
    source: Where `available` comes from.
  """
  chosen = [c for _, c in plan] if isinstance(plan, list) else [plan]
  needed = max(c.process_bytes for c in chosen)
  if available is None:
    available, source = AvailableBytes()
  if available is None or needed <= available:
    return None
  try:
    text, flags = replan(int(available / max(1, devices)))
    fit = ' '.join(f'--{k}={v}' for k, v in flags.items()) + (
        f" --model_params_override='{text}'")
  except ValueError:
    fit = None
  return PlanWarning(needed, devices, available, source or 'the memory',
                     fit)


def VariablesWarning(variable_bytes: float, available=None,
                     source: str = '') -> Optional[str]:
  """The warning line when the built model's variables alone do not fit.

  Without --plan=auto there is no prediction of the activations; the
  variables (parameters, optimizer slots) are known once the graph is built,
  before the session allocates them.
  """
  if available is None:
    available, source = AvailableBytes()
  if available is None or variable_bytes <= available:
    return None
  size = task_health.FormatBytes
  return (f'warning: the model\'s variables and optimizer slots alone take '
          f'{size(variable_bytes)}, more than {source} ({size(available)}): '
          'it may be killed by the OOM killer; run it on more memory, with '
          'bf16 (task.fprop_dtype), or let --plan=auto --devices=N '
          '--memory_per_device=SIZE choose a plan that fits.')


def GraphVariableBytes(graph) -> int:
  """Bytes of the global variables of a built graph (static shapes)."""
  total = 0
  for v in graph.get_collection('variables'):
    shape = v.shape
    if not shape.is_fully_defined():
      continue
    total += shape.num_elements() * v.dtype.base_dtype.size
  return total
