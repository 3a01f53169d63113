"""A chosen plan applied: experiment params, trainer flags, text (pure Python).
"""

from typing import Dict
from typing import List
from typing import Sequence

from lingvo_ext.pipeline import records
from lingvo_ext.planner.model_profile import FormatSize
from lingvo_ext.planner.plans import Candidate
from lingvo_ext.planner.plans import Plan

# --- Applying a plan ----------------------------------------------------------


def Overrides(plan: Plan) -> Dict[str, object]:
  """The experiment params the plan sets: key -> value."""
  out = {
      'task.num_partitions': plan.num_cells,
      'task.num_micro_batches': plan.num_micro_batches,
      'task.partition_cost': 'flops',
      'task.schedule': plan.schedule,
      # None lets '1f1b' decide per gradient (schedules.py); the planner
      # only gives it recompute where it must recompute.
      'task.recompute': (None if plan.schedule in records.ALWAYS_RECOMPUTE +
                         records.LINEAR_LOSS_ONLY else plan.recompute),
      'task.gradient_sync': plan.gradient_sync,
      'input.batch_size': plan.replica_batch,
  }
  if plan.jit_compile != 'auto':  # 'auto' (the task's default) times both.
    out['task.jit_compile'] = plan.jit_compile
  return out


def OverrideString(plan: Plan) -> str:
  """The --model_params_override text that runs the plan."""
  items = []
  for key, value in Overrides(plan).items():
    text = '"%s"' % value if isinstance(value, str) else str(value)
    items.append('%s:%s' % (key, text))
  return '; '.join(items)


def TrainerFlags(plan: Plan) -> List[str]:
  """Trainer flags that give the plan its devices (local CPU devices)."""
  return ['--num_cpu_devices=%d' % plan.devices,
          '--worker_split_size=%d' % plan.devices_per_replica]


def JoinOverrides(first: str, then: str) -> str:
  """Two --model_params_override texts as one, `then` applied last."""
  first = first.strip().rstrip(';').strip()
  return first + '; ' + then if first else then


def Command(model: str, plan: Plan, overrides: str = '') -> str:
  """The trainer command line that runs the plan (after `overrides`, the
  user's --model_params_override)."""
  return (".venv/bin/python -m lingvo_ext.trainer --model=%s %s "
          "--model_params_override='%s' --logdir=LOGDIR" %
          (model, ' '.join(TrainerFlags(plan)),
           JoinOverrides(overrides, OverrideString(plan))))


def SetKeys(model_params, values: Dict[str, object]):
  """Sets {dotted key: value} on params, typed: no text parsed back.

  Returns:
    model_params, changed in place.
  """
  for key, value in values.items():
    node = model_params
    parts = key.split('.')
    for part in parts[:-1]:
      node = node.Get(part)
    node.Set(**{parts[-1]: value})
  return model_params


def ApplyPlan(model_params, plan: Plan):
  """Sets the plan on an experiment's params (`experiment_params.GetParams`).

  The values of `Overrides(plan)`, set as they are; `OverrideString(plan)`
  is the same change as text, the record that reproduces it.

  Args:
    model_params: The experiment's params (with `task` and `input`).
    plan: The plan.

  Returns:
    model_params, changed in place.
  """
  return SetKeys(model_params, Overrides(plan))


def Describe(plan: Candidate) -> str:
  """One line: the plan and its predicted figures."""
  return ('%s: cut %s, predicted step %.1f ms, bubble %.0f%%, peak %s per '
          'device, %s between devices per step' %
          (plan.Key(), '+'.join(map(str, plan.sizes)), 1e3 * plan.step_s,
           100 * plan.bubble, FormatSize(plan.peak_bytes),
           FormatSize(plan.comm_bytes)))


def Table(plans: Sequence[Candidate], limit: int = 20) -> str:
  """A ranked text table of candidates."""
  has_measured = any(p.measured_step_s is not None for p in plans)
  head = ['#', 'plan', 'cut', 'step ms', 'bubble', 'peak/device',
          'bytes/step']
  if has_measured:
    head += ['measured ms', 'measured RSS']
  rows = [head]
  for i, p in enumerate(plans[:limit]):
    row = [str(i + 1), p.Key(), '+'.join(map(str, p.sizes)),
           '%.1f' % (1e3 * p.step_s), '%.0f%%' % (100 * p.bubble),
           FormatSize(p.peak_bytes), FormatSize(p.comm_bytes)]
    if has_measured:
      row += ['-' if p.measured_step_s is None else
              '%.1f' % (1e3 * p.measured_step_s),
              '-' if p.measured_rss_bytes is None else
              FormatSize(p.measured_rss_bytes)]
    rows.append(row)
  widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
  lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
           for r in rows]
  if len(plans) > limit:
    lines.append('... and %d more' % (len(plans) - limit))
  return '\n'.join(lines)


# --- Spearman, for the benchmark and tests ------------------------------------
