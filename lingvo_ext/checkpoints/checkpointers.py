"""Lingvo's Checkpointer for lingvo_ext: finite saves, restores across cuts.

`NonFiniteVariables` lets a job refuse to save variables that are NaN or Inf.
`CrossCutCheckpointer` restores a checkpoint written under another cut of a
pipeline's layers into cells; `TrainingCheckpointer` is the controller's;
`NewCheckpointer` picks a runner's.
"""

import contextlib
import os
from typing import List

import lingvo.compat as tf
from lingvo.core import checkpointer as lingvo_checkpointer
from lingvo.core import py_utils
import numpy as np

from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.checkpoints import files
from lingvo_ext.pipeline import cut_checkpoints


def FiniteChecks(variables):
  """[(name, scalar bool tensor: all finite)] for float `variables`.

  Built at every trainer start: three ops per variable (its read, IsFinite
  and All over an axes constant shared by the variables of one device and
  rank), where tf.reduce_all(tf.math.is_finite(v.read_value())) adds six.
  """
  checks, axes = [], {}
  for v in variables:
    if not v.dtype.base_dtype.is_floating:
      continue
    with tf.device(v.device):
      x = tf.raw_ops.IsFinite(x=tf.convert_to_tensor(v))
      rank = v.shape.rank
      if rank is None:
        checks.append((v.op.name, tf.reduce_all(x)))
        continue
      key = (v.device, rank)
      if key not in axes:
        with tf.control_dependencies(None), tf.name_scope('finite_checks'):
          axes[key] = tf.constant(list(range(rank)), tf.int32)
      checks.append((v.op.name, tf.raw_ops.All(input=x, axis=axes[key])))
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
  renamed keys (lingvo_ext/pipeline/cuts.py), with one line saying so.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # The state file names checkpoints relative to the logdir (it can move).
    internal_lingvo.WriteRelativeStateFile(self)
    self._cross_cut_savers = {}
    # Its uninitialized-variables report is only run on a restore; a job that
    # ends without one (an evaler with nothing left to do) would print TF's
    # 'Object was never used' error when the tensor is collected.
    mark_used = getattr(self._uninitialized_vars, 'mark_used', None)
    if mark_used:
      mark_used()

  def _SavedVariables(self):
    """{checkpoint key: variable} of what this checkpointer restores."""
    var_list = internal_lingvo.SaverVariables(self)
    if isinstance(var_list, dict):
      return dict(var_list)
    return {v.name[:-2] if v.name.endswith(':0') else v.name: v
            for v in var_list}

  def RestoreFromPath(self, sess=None, checkpoint_path=None):
    variables = self._SavedVariables()
    keys = tf.train.load_checkpoint(
        checkpoint_path).get_variable_to_shape_map()
    if set(variables) <= set(keys) or not all(
        isinstance(v, tf.compat.v2.Variable) and
        not internal_tf.SaveSliceInfo(v)
        for v in variables.values()):
      # The same names, or saveables a rename cannot restore (partitioned
      # variables, stacked views): Lingvo's restore.
      return super().RestoreFromPath(sess, checkpoint_path)
    try:
      plan = cut_checkpoints.PlanRestore(self._models, keys, variables,
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
    copies = internal_lingvo.AsyncCopiesInitializer(self)
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


class TrainingCheckpointer(CrossCutCheckpointer):
  """The controller's checkpointer: finite saves, a kept step, a first save.

  What the trainer's controller returns from Lingvo's
  BaseRunner._CreateCheckpointer (its extension point):

  - `Save` refuses variables that hold NaN or Inf, and removes a checkpoint
    that became non-finite while it was written (DropLatestIfNonFinite);
  - with `step_keeper` (a live multi-process cluster), `RestoreIfNeeded`
    restores a restarted task's weights without rewinding the step
    (distributed/step_keeping.py);
  - `on_save_attempt` is called after every save attempt (the trainer waits
    for the first one, so that a new run's first checkpoint holds the initial
    weights);
  - `finite_checks` (FiniteChecks of the same graph, e.g. the trainer's whose
    model a controller shares) are used for the variables they cover;
  - a checkpoint is named by the step it stores: Lingvo's async saver names
    it from its copy of `global_step` (internal_lingvo.NameSavesFromSnapshot),
    and with `snapshot_lock` (held by the trainer of this process around each
    step) the copy, or a synchronous save, and the step it is named by are
    taken between two steps.

  Built in the controller's graph, after its model.
  """

  def __init__(self, train_dir, models, *args, on_save_attempt=None,
               step_keeper=None, finite_checks=None, snapshot_lock=None,
               **kwargs):
    super().__init__(train_dir, models, *args, **kwargs)
    self._on_save_attempt = on_save_attempt
    self._snapshot_lock = snapshot_lock or contextlib.nullcontext()
    internal_lingvo.NameSavesFromSnapshot(self)
    self._global_step = py_utils.GetGlobalStep()
    # What the checkpoint holds (not, e.g., Lingvo's async-save copies,
    # refilled from these at each save).
    saved = list(self._SavedVariables().values())
    if not all(isinstance(v, tf.compat.v2.Variable) for v in saved):
      saved = tf.global_variables()
    # Outside the runner's placer: each check runs on its variable's device.
    built = dict(finite_checks or [])
    with tf.device(None):
      self._finite_checks = [(v.op.name, built[v.op.name]) for v in saved
                             if v.op.name in built] + FiniteChecks(
                                 [v for v in saved if v.op.name not in built])
      self._keeper = step_keeper(self._models) if step_keeper else None

  def Save(self, sess=None, gsteps=None, sync=True):
    try:
      bad = NonFiniteVariables(sess, self._finite_checks)
      if bad:
        tf.logging.warning(
            'Not saving a checkpoint at step %s: variable %s (and %d more) '
            'holds NaN or Inf.', gsteps, bad[0], len(bad) - 1)
        return
      with self._snapshot_lock:
        # The step it stores (a training step may have run since `gsteps`
        # was read): tf.train.Saver names the checkpoint by it.
        gsteps = int(sess.run(self._global_step))
        super().Save(sess, gsteps, sync=False)
      if sync:
        self.FinishSave()
    finally:
      if self._on_save_attempt:
        self._on_save_attempt()

  def FinishSave(self):
    """Waits for an async save's write, then what Save(sync=True) checks."""
    self.Sync()
    self._DropLatestIfNonFinite()

  def _DropLatestIfNonFinite(self):
    dropped = files.DropLatestIfNonFinite(self._train_dir)
    if dropped:
      tf.logging.warning(
          'Removed checkpoint %s: %s became NaN or Inf while it was '
          'saved.', *dropped)

  def MaybeSave(self, sess=None, gsteps=None, sync=True):
    if self._keeper:
      self._keeper.Seen(gsteps)
    return super().MaybeSave(sess, gsteps, sync)

  def RestoreIfNeeded(self, sess):
    if not self._keeper:
      return super().RestoreIfNeeded(sess)
    names = self._GetUninitializedVarNames(sess)
    if not names:
      return None
    return self._keeper.Restore(
        sess, names, lambda: super(TrainingCheckpointer,
                                   self).RestoreIfNeeded(sess))


def NewCheckpointer(train_dir, model, default, **kwargs):
  """A runner's checkpointer: `default()` in eager mode, else cross-cut.

  kwargs: TrainingCheckpointer's (the controller's); none for the others.
  """
  if py_utils.IsEagerMode():
    return default()
  if kwargs:
    return TrainingCheckpointer(train_dir, model, **kwargs)
  return CrossCutCheckpointer(train_dir, model)
