"""Checkpoint safety for the trainer: intact restores, finite saves.

Lingvo's saver writes a checkpoint atomically: the shards go to
`ckpt-N_temp/`, are merged into `ckpt-N.index` / `.data-*`, and only then is
the `checkpoint` state file replaced (an atomic rename) to name it. A
checkpoint can still be damaged afterwards (a full disk, a copy cut short).
`FallBackToIntactCheckpoint` makes the state file name the newest checkpoint
that reads back whole, and says which ones it skipped and why.
`NonFiniteVariables` lets a job refuse to save variables that are NaN or Inf.
`CrossCutCheckpointer` restores a checkpoint written under another cut of a
pipeline's layers into cells.
"""

import os
from typing import List, Optional, Tuple

from google.protobuf import text_format
import lingvo.compat as tf
from lingvo.core import checkpointer as lingvo_checkpointer
import numpy as np
from tensorflow.python.lib.io import file_io  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import variables as tf_variables  # pylint: disable=g-direct-tensorflow-import

from lingvo_ext.core import cuts


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


def _Step(path: str) -> int:
  try:
    return int(path.rsplit('-', 1)[1])
  except (IndexError, ValueError):
    return -1


def FallBackToIntactCheckpoint(
    train_dir: str) -> Tuple[Optional[str], List[Tuple[str, str]]]:
  """Points `train_dir`'s latest checkpoint at the newest intact one.

  Args:
    train_dir: The directory with the `checkpoint` state file.

  Returns:
    (the newest intact checkpoint or None, [(skipped path, why)] newest
    first). When checkpoints were skipped, the state file is rewritten
    (atomically) to name the intact ones only; the damaged files are left in
    place for inspection.
  """
  paths = sorted(_AllCheckpoints(train_dir), key=_Step, reverse=True)
  skipped = []
  for i, path in enumerate(paths):
    problem = CheckpointProblem(path)
    if problem is None:
      if skipped:
        _WriteState(train_dir, path, {p for p, _ in skipped})
      return path, skipped
    skipped.append((path, problem))
  if skipped:
    # None is intact: remove the state file, so training starts afresh
    # rather than failing on every restore.
    tf.io.gfile.remove(os.path.join(train_dir, 'checkpoint'))
  return None, skipped


def _WriteState(train_dir, latest, dropped):
  """Rewrites the state file: `latest` first, `dropped` paths removed."""
  state = tf.train.get_checkpoint_state(train_dir)
  absolute = lambda p: p if os.path.isabs(p) else os.path.join(train_dir, p)
  pairs = list(zip(state.all_model_checkpoint_paths,
                   state.all_model_checkpoint_timestamps))
  paths = [p for p in state.all_model_checkpoint_paths
           if absolute(p) not in dropped]
  del state.all_model_checkpoint_paths[:]
  state.all_model_checkpoint_paths.extend(paths)
  if pairs:  # Lingvo's saver keeps one timestamp per path.
    stamps = [t for p, t in pairs if absolute(p) not in dropped]
    del state.all_model_checkpoint_timestamps[:]
    state.all_model_checkpoint_timestamps.extend(stamps)
  state.model_checkpoint_path = latest
  file_io.atomic_write_string_to_file(
      os.path.join(train_dir, 'checkpoint'),
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


def FiniteChecks(variables):
  """[(name, scalar bool tensor: all finite)] for float `variables`."""
  checks = []
  for v in variables:
    if v.dtype.base_dtype.is_floating:
      with tf.device(v.device):
        checks.append(
            (v.op.name, tf.reduce_all(tf.math.is_finite(v.read_value()))))
  return checks


def NonFiniteVariables(sess, checks) -> List[str]:
  """Names of the variables of `checks` (FiniteChecks) holding NaN or Inf."""
  if not checks:
    return []
  ok = sess.run([t for _, t in checks])
  return [name for (name, _), good in zip(checks, ok) if not np.all(good)]


class CrossCutCheckpointer(lingvo_checkpointer.Checkpointer):
  """Lingvo's Checkpointer; also restores a checkpoint of another cut.

  A pipeline's variable names show how its layers were cut into cells
  (`lm/d1/cell_003/w/var`) and named. When a checkpoint's keys differ from
  the model's in that alone (e.g. written by lingvo.core.gpipe's heuristic
  cut, or with other `num_partitions` under Lingvo's names, or before
  `keep_layer_names`), it is restored through a `tf.train.Saver` over the
  renamed keys (lingvo_ext/core/cuts.py), with one line saying so.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._cross_cut_savers = {}

  def _SavedVariables(self):
    """{checkpoint key: variable} of what this checkpointer restores."""
    var_list = self._saver._var_list  # pylint: disable=protected-access
    if isinstance(var_list, dict):
      return dict(var_list)
    return {v.name[:-2] if v.name.endswith(':0') else v.name: v
            for v in var_list}

  def RestoreFromPath(self, sess=None, checkpoint_path=None):
    variables = self._SavedVariables()
    keys = tf.train.load_checkpoint(
        checkpoint_path).get_variable_to_shape_map()
    if set(variables) <= set(keys) or not all(
        isinstance(v, tf_variables.Variable) and
        not getattr(v, '_save_slice_info', None)
        for v in variables.values()):
      # The same names, or saveables a rename cannot restore (partitioned
      # variables, stacked views): Lingvo's restore.
      return super().RestoreFromPath(sess, checkpoint_path)
    try:
      plan = cuts.PlanRestore(self._models, keys, variables,
                              source=checkpoint_path)
    except ValueError as e:
      tf.logging.warning('Not a checkpoint of another cut: %s', e)
      return super().RestoreFromPath(sess, checkpoint_path)
    key = tuple(sorted(plan.keys.items()))
    if key not in self._cross_cut_savers:
      with sess.graph.as_default():
        self._cross_cut_savers[key] = tf.train.Saver(
            var_list={k: variables[t] for k, t in plan.keys.items()},
            sharded=True)
    self._cross_cut_savers[key].restore(sess, checkpoint_path)
    # As Lingvo's saver does after a restore: its async-save copies of the
    # variables are not in checkpoints.
    inner = getattr(self._saver, '_saver', None)
    copies = getattr(inner, '_copied_vars_initializer', None)
    if copies is not None:
      sess.run(copies)
    message = (f'restored {len(plan.keys)} variables of '
               f'{os.path.basename(checkpoint_path)} across a different cut '
               f'({plan.num_renamed} renamed): {plan.Describe()}')
    print(message, flush=True)
    tf.logging.info('%s', message)
    uninitialized = self._GetUninitializedVarNames(sess)
    if self._check_loading_status:
      assert not uninitialized, uninitialized
    return checkpoint_path
