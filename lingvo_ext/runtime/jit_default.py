"""The trainer's XLA choice: pipelines whose `jit_compile` is unset.

A `PipeliningLayer`'s `jit_compile` defaults to None (unset, built as
False). In a local training run the trainer sets every unset one from its
`--jit_compile` flag (default auto): with `auto`, to `'auto'`, the faster
of the two builds for this model on this machine (core/jit_choice.py: timed
once, cached across processes), when the run has at least
`--jit_auto_min_steps` steps to go; fewer steps than that would not win back
XLA's compile and the timing, so they build without XLA and time nothing.
A value the experiment or an override sets is the user's and is kept. docs/performance.md, "XLA".
"""

import dataclasses
from typing import List
from typing import Optional
from typing import Tuple

from lingvo_ext.core import jit_choice
from lingvo_ext.tasks import pipeline_tree

DEFAULT_MIN_STEPS = 10000


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the trainer set: `value` on each of `paths`, and why."""
  value: object
  paths: Tuple[str, ...]
  reason: str

  def Line(self) -> str:
    """The log line, e.g. "jit_compile: 'auto' for task (...)"."""
    return 'jit_compile: %r for %s (%s).' % (self.value, ', '.join(
        self.paths), self.reason)


def CheckFlags(min_steps: int) -> Optional[str]:
  """The error line for a bad --jit_auto_min_steps, or None (absl checks
  --jit_compile's values)."""
  if min_steps < 0:
    return (f'--jit_auto_min_steps={min_steps} must be >= 0, e.g. '
            f'{DEFAULT_MIN_STEPS}.')
  return None


def Unset(cfg) -> List[Tuple[str, object]]:
  """[(override path, params holding it)] of each unset jit_compile.

  A lingvo_ext `PipelinedTask` keeps it on the task (`task.jit_compile`);
  any other experiment on its PipeliningLayers in the tree (e.g.
  `task.lm.stack.jit_compile`). Lingvo's own engine has no such param.
  """
  holders = []
  if pipeline_tree.IsPipelinedTask(cfg.task):
    holders.append(('task', cfg.task))
  else:
    holders += [(f'task.{path}', p)
                for path, p in pipeline_tree.Pipelines(cfg.task)]
  return [(f'{path}.jit_compile', p) for path, p in holders
          if 'jit_compile' in p and
          jit_choice.Normalize(path, p.jit_compile) is None]


def Choose(choice: str, steps_to_go: int, min_steps: int):
  """(value, reason) that --jit_compile=`choice` gives an unset jit_compile."""
  if choice != 'auto':
    return choice == 'True', f'--jit_compile={choice}'
  if steps_to_go >= min_steps:
    return 'auto', (f'{steps_to_go} steps to go >= --jit_auto_min_steps='
                    f'{min_steps}: the faster build, timed once per model '
                    'and machine')
  return False, (f'{steps_to_go} steps to go < --jit_auto_min_steps='
                 f'{min_steps}: too few to win back an XLA compile')


def Apply(cfg, choice: str, steps_to_go: int,
          min_steps: int = DEFAULT_MIN_STEPS) -> Optional[Decision]:
  """Sets each unset jit_compile of `cfg` (in place); None if none is."""
  unset = Unset(cfg)
  if not unset:
    return None
  value, reason = Choose(choice, steps_to_go, min_steps)
  for _, p in unset:
    p.jit_compile = value
  return Decision(value, tuple(path for path, _ in unset), reason)
