"""A logdir's checkpoints on disk: intact restores, its state file, its end.

Lingvo's saver writes a checkpoint atomically: the shards go to
`ckpt-N_temp/`, are merged into `ckpt-N.index` / `.data-*`, and only then is
the `checkpoint` state file replaced (an atomic rename) to name it. A
checkpoint can still be damaged afterwards (a full disk, a copy cut short).
`FallBackToIntactCheckpoint` makes the state file name the newest checkpoint
that reads back whole, and says which ones it skipped and why;
`RebuildStateFile` repairs a damaged state file, `LocalizeStateFile` one of
a moved logdir; `MarkTrainingFinished` records a trainer's end for its
evalers.
"""

import os
import re
from typing import List
from typing import Optional
from typing import Tuple

from google.protobuf import text_format
import lingvo.compat as tf
import numpy as np

from lingvo_ext._internal import tf as internal_tf


def CheckpointProblem(path: str) -> Optional[str]:
  """Why the checkpoint at prefix `path` cannot be restored, or None.

  Reads every tensor, so a truncated or corrupted .data file is found (the
  reader checks sizes and checksums).
  """
  if not tf.io.gfile.exists(path + '.index'):
    return f'{path}.index is missing'
  try:
    reader = tf.train.load_checkpoint(path)
    for name in sorted(reader.get_variable_to_shape_map()):
      reader.get_tensor(name)
  except Exception as e:  # pylint: disable=broad-except
    # The reader raises OpErrors, or IndexError on a truncated file.
    first = str(getattr(e, 'message', e)).strip().split('\n')[0]
    return f'{type(e).__name__}: {first}'
  return None


def _AllCheckpoints(train_dir: str) -> List[str]:
  state = tf.train.get_checkpoint_state(train_dir)
  if not state or not state.model_checkpoint_path:
    return []
  paths = list(state.all_model_checkpoint_paths)
  if state.model_checkpoint_path not in paths:
    paths.append(state.model_checkpoint_path)
  return [p if os.path.isabs(p) else os.path.join(train_dir, p) for p in paths]


def CheckpointPaths(train_dir: str) -> List[str]:
  """The checkpoints the state file names (absolute paths), or []."""
  return _AllCheckpoints(train_dir)


def _Step(path: str) -> int:
  try:
    return int(path.rsplit('-', 1)[1])
  except (IndexError, ValueError):
    return -1


def FallBackToIntactCheckpoint(
    train_dir: str, problem=CheckpointProblem
) -> Tuple[Optional[str], List[Tuple[str, str]]]:
  """Points `train_dir`'s latest checkpoint at the newest intact one.

  Args:
    train_dir: The directory with the `checkpoint` state file.
    problem: problem(path): why a checkpoint does not read back, or None.

  Returns:
    (the newest intact checkpoint or None, [(skipped path, why)] newest
    first). When checkpoints were skipped, the state file is rewritten
    (atomically) to name the intact ones only; the damaged files are left in
    place for inspection.
  """
  paths = sorted(_AllCheckpoints(train_dir), key=_Step, reverse=True)
  skipped = []
  for path in paths:
    why = problem(path)
    if why is None:
      PointStatePast(train_dir, path, skipped)
      return path, skipped
    skipped.append((path, why))
  PointStatePast(train_dir, None, skipped)
  return None, skipped


def PointStatePast(train_dir: str, latest: Optional[str], skipped) -> None:
  """Names `latest` the latest checkpoint, without the `skipped` [(path, _)].

  With no `latest` (none is intact) the state file is removed, so training
  starts afresh rather than failing on every restore. Nothing is written
  when nothing was skipped.
  """
  if not skipped:
    return
  if latest:
    _WriteState(train_dir, latest, {p for p, _ in skipped})
  else:
    tf.io.gfile.remove(os.path.join(train_dir, 'checkpoint'))


def _WriteState(train_dir, latest, dropped):
  """Rewrites the state file: `latest` last (the latest), `dropped` removed."""
  state = tf.train.get_checkpoint_state(train_dir)
  absolute = lambda p: p if os.path.isabs(p) else os.path.join(train_dir, p)
  latest = absolute(latest)
  paths = [absolute(p) for p in state.all_model_checkpoint_paths]
  # Lingvo's saver keeps one timestamp per path.
  stamps = list(state.all_model_checkpoint_timestamps)
  if len(stamps) != len(paths):
    stamps = [None] * len(paths)
  kept = [(p, t) for p, t in zip(paths, stamps)
          if p not in dropped and p != latest]
  kept.append((latest, dict(zip(paths, stamps)).get(latest)))
  stamps = [t for _, t in kept]
  _WriteStateFile(train_dir, latest, [p for p, _ in kept],
                  None if None in stamps else stamps,
                  state.last_preserved_timestamp)


def _WriteStateFile(train_dir, latest, paths, stamps=None,
                    last_preserved=None):
  """Writes the state file atomically, naming train_dir's files by name.

  Relative names (as Lingvo's saver writes them here, through
  internal_lingvo.WriteRelativeStateFile) keep a copied logdir on its own
  checkpoints; TF's readers join them with `train_dir`.
  """
  name = lambda p: os.path.basename(p) if os.path.normpath(
      os.path.dirname(p)) == os.path.normpath(train_dir) else p
  state = internal_tf.CheckpointState(
      model_checkpoint_path=name(latest),
      all_model_checkpoint_paths=[name(p) for p in paths],
      all_model_checkpoint_timestamps=stamps or [],
      last_preserved_timestamp=last_preserved or 0)
  _AtomicWrite(os.path.join(train_dir, 'checkpoint'),
               text_format.MessageToString(state))


def DropLatestIfNonFinite(train_dir: str) -> Optional[Tuple[str, str]]:
  """Deletes the newest checkpoint if it holds NaN or Inf; (path, tensor).

  The check before a save and the save itself are two session runs, and a
  concurrent training step can make the variables non-finite in between; so
  the written checkpoint is read back and, when not finite, removed and the
  state file pointed at the previous one.
  """
  paths = sorted(_AllCheckpoints(train_dir), key=_Step, reverse=True)
  if not paths:
    return None
  latest = paths[0]
  reader = tf.train.load_checkpoint(latest)
  for name in sorted(reader.get_variable_to_shape_map()):
    value = np.asarray(reader.get_tensor(name))
    if np.issubdtype(value.dtype, np.floating) and not np.all(
        np.isfinite(value)):
      if len(paths) > 1:
        _WriteState(train_dir, paths[1], {latest})
      else:
        tf.io.gfile.remove(os.path.join(train_dir, 'checkpoint'))
      for f in tf.io.gfile.glob(latest + '.*'):
        tf.io.gfile.remove(f)
      return latest, name
  return None


# --- A damaged `checkpoint` state file ----------------------------------------

_CKPT_INDEX = re.compile(r'^(ckpt-(\d+))\.index$')


def _CheckpointsOnDisk(train_dir: str) -> List[str]:
  """Prefixes of the `ckpt-N` checkpoints in `train_dir`, oldest first."""
  found = []
  for name in tf.io.gfile.listdir(train_dir):
    m = _CKPT_INDEX.match(name)
    if m:
      found.append((int(m.group(2)), os.path.join(train_dir, m.group(1))))
  return [path for _, path in sorted(found)]


def StateFileProblem(train_dir: str) -> Optional[str]:
  """Why `train_dir`'s `checkpoint` state file needs rebuilding, or None.

  It does when it does not parse, names no checkpoint, or names one whose
  index file is gone, while checkpoints are on disk; also when it is missing
  while checkpoints are on disk (a run would otherwise start afresh and
  overwrite them).
  """
  if not tf.io.gfile.isdir(train_dir) or not _CheckpointsOnDisk(train_dir):
    return None
  state_file = os.path.join(train_dir, 'checkpoint')
  if not tf.io.gfile.exists(state_file):
    return f'{state_file} is missing'
  # Parsed here: TF's get_checkpoint_state logs a parse error twice and
  # returns None.
  state = internal_tf.CheckpointState()
  try:
    with tf.io.gfile.GFile(state_file, 'rb') as f:
      text_format.Parse(f.read(), state)
  except Exception as e:  # pylint: disable=broad-except
    # text_format.ParseError, or a decoding error for binary garbage.
    first = str(e).strip().split('\n')[0]
    return f'{state_file} does not parse ({type(e).__name__}: {first})'
  if not state.model_checkpoint_path:
    return f'{state_file} names no checkpoint'
  path = state.model_checkpoint_path
  if not os.path.isabs(path):
    path = os.path.join(train_dir, path)
  if not tf.io.gfile.exists(path + '.index'):
    return f'{state_file} names {path}, which is not on disk'
  return None


def RebuildStateFile(train_dir: str) -> Optional[str]:
  """Rewrites a damaged `checkpoint` state file from the checkpoints on disk.

  Every `ckpt-N` in `train_dir` is listed (newest last), the newest as the
  latest: FallBackToIntactCheckpoint then skips any that does not read back.
  Written atomically, naming the checkpoints relatively.

  Returns:
    None when the state file was fine (or there are no checkpoints), else
    the problem that was repaired.
  """
  problem = StateFileProblem(train_dir)
  if problem is None:
    return None
  paths = _CheckpointsOnDisk(train_dir)
  stamps = [tf.io.gfile.stat(p + '.index').mtime_nsec / 1e9 for p in paths]
  _WriteStateFile(train_dir, paths[-1], paths, stamps)
  return problem


# --- Training finished ----------------------------------------------------------

_FINISHED = 'training_finished'


def MarkTrainingFinished(train_dir: str, step: int, max_steps: int) -> None:
  """Records that training ended at `step` (its last checkpoint's step).

  Evalers and decoders stop once they have processed that checkpoint, when
  the trainer ran with any --max_steps.
  """
  _AtomicWrite(os.path.join(train_dir, _FINISHED),
               f'{int(step)} {int(max_steps)}\n')


def _AtomicWrite(path, text):
  """Writes `text` to `path` through a temporary file and a rename."""
  temp = f'{path}.tmp{os.getpid()}'
  with tf.io.gfile.GFile(temp, 'w') as f:
    f.write(text)
  tf.io.gfile.rename(temp, path, overwrite=True)


def TrainingFinished(train_dir: str) -> Optional[Tuple[int, int]]:
  """(step, max_steps) if the trainer of `train_dir` finished, else None."""
  try:
    with tf.io.gfile.GFile(os.path.join(train_dir, _FINISHED)) as f:
      step, max_steps = f.read().split()
    return int(step), int(max_steps)
  except (tf.errors.NotFoundError, ValueError):
    return None


def ClearTrainingFinished(train_dir: str) -> None:
  """A trainer that goes on (a raised --max_steps) is not finished."""
  path = os.path.join(train_dir, _FINISHED)
  if tf.io.gfile.exists(path):
    tf.io.gfile.remove(path)


def CheckpointStep(path: Optional[str]) -> Optional[int]:
  """The step of checkpoint prefix `path` (`.../ckpt-00000100` is 100)."""
  if not path:
    return None
  step = _Step(path)
  return None if step < 0 else step


# --- A logdir that moved ----------------------------------------------------------


def OwnCopy(train_dir: str, path: str) -> Optional[str]:
  """`train_dir`'s checkpoint named as `path` when `path` is elsewhere."""
  if not os.path.isabs(path) or os.path.dirname(
      os.path.normpath(path)) == os.path.normpath(train_dir):
    return None  # Relative, or already in train_dir.
  return os.path.join(train_dir, os.path.basename(path))


def LatestCheckpoint(train_dir: str) -> Optional[str]:
  """tf.train.latest_checkpoint, read as if the logdir never moved.

  A `checkpoint` state file of another writer (or of a version that named
  checkpoints by absolute path): in a copied or moved logdir it names the
  original's files. Those become this logdir's
  files of the same names when they are here.
  """
  state = tf.train.get_checkpoint_state(train_dir)
  own = state and state.model_checkpoint_path and OwnCopy(
      train_dir, state.model_checkpoint_path)
  if own and tf.io.gfile.exists(own + '.index'):
    return own
  return tf.train.latest_checkpoint(train_dir)


def LocalizeStateFile(train_dir: str) -> Optional[str]:
  """Points a moved logdir's state file at its own checkpoints.

  Paths outside `train_dir` are replaced by `train_dir`'s files of the same
  names when all of those are here (the state file is rewritten
  atomically).

  Returns:
    None when every path was inside `train_dir`; else a one-line note of
    what was done, or of where the paths point when the files are not here.
  """
  state_file = os.path.join(train_dir, 'checkpoint')
  if not tf.io.gfile.exists(state_file):
    return None
  state = internal_tf.CheckpointState()
  try:
    with tf.io.gfile.GFile(state_file, 'rb') as f:
      text_format.Parse(f.read(), state)
  except Exception:  # pylint: disable=broad-except
    return None  # RebuildStateFile repairs it.
  paths = [state.model_checkpoint_path, *state.all_model_checkpoint_paths]
  moved = [p for p in paths if p and OwnCopy(train_dir, p)]
  if not moved:
    return None
  elsewhere = os.path.dirname(moved[0])
  missing = [p for p in moved
             if not tf.io.gfile.exists(OwnCopy(train_dir, p) + '.index')]
  if missing:
    return (f'{state_file} names checkpoints in {elsewhere}, outside this '
            f'logdir, and {os.path.basename(missing[0])} is not in '
            f'{train_dir}; using the paths as written.')
  own = lambda p: OwnCopy(train_dir, p) or p
  _WriteStateFile(train_dir, own(state.model_checkpoint_path),
                  [own(p) for p in state.all_model_checkpoint_paths],
                  list(state.all_model_checkpoint_timestamps),
                  state.last_preserved_timestamp)
  return (f'{state_file} named checkpoints in {elsewhere} (a copied or moved '
          'logdir); using this logdir\'s own files of the same names.')
