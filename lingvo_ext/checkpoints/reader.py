"""The one reader of a logdir's checkpoints, for every job that reads them.

The trainer resuming, an evaler or decoder (and `--eval_once`),
`lingvo-ext-export`, `tools.convert_checkpoint` given a directory, and a
user's Predictor (docs/serving.md) all take the checkpoint to read from
`NewestIntactCheckpoint`: the newest one that reads back whole. Each newer
damaged one (a .data file cut short by a full disk or a copy) is named once
per process, on stderr, by the same line (`SkippedLine`):

  warning: skipped damaged checkpoint PATH (unreadable: WHY); using PATH.

It only reads, except for the trainer (`repair=True`), which owns the
logdir and points its state file past the damaged ones.
"""

import glob
import os
import sys
from typing import Dict
from typing import Optional
from typing import Set
from typing import Tuple

from lingvo_ext.checkpoints import files

# {checkpoint prefix: (its files' sizes and mtimes, its problem or None)}:
# a checkpoint is read whole once while its files stay the same.
_CHECKED: Dict[str, Tuple[tuple, Optional[str]]] = {}
# The damaged checkpoints this process has named (SkippedLine) already.
_NAMED: Set[str] = set()


def SkippedLine(bad: str, why: str, using: str) -> str:
  """The warning for a damaged checkpoint `bad`, skipped for `using`."""
  return f'warning: skipped damaged checkpoint {bad} ({why}); using {using}.'


def _Stamp(path):
  return tuple(sorted(
      (f, s.st_size, s.st_mtime_ns) for f in glob.glob(glob.escape(path) + '.*')
      for s in [os.stat(f)]))


def ReadProblem(path: str) -> Optional[str]:
  """Why checkpoint `path` does not read back ('unreadable: ...'), or None.

  Each tensor is read once per version of the checkpoint's files.
  """
  try:
    stamp = _Stamp(path)
  except OSError:
    stamp = None
  seen = _CHECKED.get(path)
  if seen and stamp is not None and seen[0] == stamp:
    return seen[1]
  problem = files.CheckpointProblem(path)
  if problem:
    problem = f'unreadable: {problem}'
  if stamp is not None:
    _CHECKED[path] = (stamp, problem)
  return problem


def _Candidates(train_dir):
  """train_dir's checkpoints, newest first: the state file's, else on disk."""
  paths = []
  for p in files.CheckpointPaths(train_dir):
    own = files.OwnCopy(train_dir, p)  # A moved logdir's own files.
    paths.append(own if own and os.path.exists(own + '.index') else p)
  if not paths:
    paths = [p[:-len('.index')] for p in glob.glob(
        os.path.join(glob.escape(train_dir), 'ckpt-*.index'))]
  step = lambda p: -1 if files.CheckpointStep(p) is None else (
      files.CheckpointStep(p))
  return sorted(set(paths), key=step, reverse=True)


def NewestIntactCheckpoint(train_dir: str, say: bool = True,
                           none: str = 'none',
                           repair: bool = False) -> Optional[str]:
  """The newest checkpoint of `train_dir` that reads back whole, or None.

  Args:
    train_dir: A logdir's `train/` directory.
    say: Print SkippedLine on stderr for each damaged newer checkpoint
      (once per checkpoint and process).
    none: What the line says is used when no checkpoint is intact.
    repair: The logdir's own trainer: the state file is then pointed at the
      intact one (files.FallBackToIntactCheckpoint).
  """
  if repair:
    found, skipped = files.FallBackToIntactCheckpoint(train_dir, ReadProblem)
  else:
    found, skipped = None, []
    for path in _Candidates(train_dir):
      why = ReadProblem(path)
      if why is None:
        found = path
        break
      skipped.append((path, why))
  if say:
    for bad, why in skipped:
      if bad not in _NAMED:
        _NAMED.add(bad)
        print(SkippedLine(bad, why, found or none), file=sys.stderr,
              flush=True)
  return found
