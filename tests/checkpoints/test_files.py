"""A logdir's checkpoints on disk and its state file (checkpoints/files.py)."""

import os
import shutil

import numpy as np
import tensorflow as tf

from lingvo_ext.checkpoints import files


def _Logdir(path, values):
  """train_dir with ckpt-N for each N: value, the state file naming them.

  Written in a graph and session of its own, as the trainer's saver writes:
  a test run earlier in the process may have left TensorFlow in graph mode.
  """
  train_dir = str(path)
  os.makedirs(train_dir, exist_ok=True)
  prefixes = []
  for step, value in values.items():
    prefix = os.path.join(train_dir, 'ckpt-%08d' % step)
    with tf.Graph().as_default():
      w = tf.compat.v1.get_variable(
          'w', initializer=tf.constant(np.float32(value)))
      saver = tf.compat.v1.train.Saver([w])
      with tf.compat.v1.Session() as sess:
        sess.run(w.initializer)
        saver.save(sess, prefix, write_meta_graph=False,
                   write_state=False)
    prefixes.append(prefix)
  tf.compat.v1.train.update_checkpoint_state(
      train_dir, prefixes[-1], all_model_checkpoint_paths=prefixes)
  return train_dir, prefixes


def test_fall_back_skips_a_damaged_checkpoint_and_names_why(tmp_path):
  train_dir, (first, second) = _Logdir(tmp_path, {1: 1., 2: 2.})
  assert files.FallBackToIntactCheckpoint(train_dir) == (second, [])
  data, = tf.io.gfile.glob(second + '.data-*')
  with open(data, 'r+b') as f:
    f.truncate(1)
  assert files.CheckpointProblem(second)
  latest, skipped = files.FallBackToIntactCheckpoint(train_dir)
  assert (latest, [p for p, _ in skipped]) == (first, [second])
  assert files.CheckpointPaths(train_dir) == [first]
  assert files.LatestCheckpoint(train_dir) == first


def test_a_checkpoint_that_became_non_finite_is_removed(tmp_path):
  train_dir, (first, second) = _Logdir(tmp_path, {1: 1., 2: np.nan})
  dropped = files.DropLatestIfNonFinite(train_dir)
  assert dropped and dropped[0] == second
  assert not tf.io.gfile.glob(second + '.*')
  assert files.LatestCheckpoint(train_dir) == first
  assert files.DropLatestIfNonFinite(train_dir) is None


def test_a_missing_state_file_is_rebuilt_from_the_files_on_disk(tmp_path):
  train_dir, (_, second) = _Logdir(tmp_path, {1: 1., 2: 2.})
  os.remove(os.path.join(train_dir, 'checkpoint'))
  problem = files.StateFileProblem(train_dir)
  assert problem and problem.endswith('checkpoint is missing')
  assert files.RebuildStateFile(train_dir) == problem
  assert files.LatestCheckpoint(train_dir) == second
  assert files.RebuildStateFile(train_dir) is None


def test_a_moved_logdir_reads_its_own_checkpoints(tmp_path):
  old_dir, _ = _Logdir(tmp_path / 'old', {3: 3.})
  new_dir = str(tmp_path / 'new')
  shutil.copytree(old_dir, new_dir)
  own = os.path.join(new_dir, 'ckpt-00000003')
  assert files.LatestCheckpoint(new_dir) == own
  assert 'a copied or moved logdir' in files.LocalizeStateFile(new_dir)
  assert files.LocalizeStateFile(new_dir) is None
  shutil.rmtree(old_dir)
  assert tf.train.latest_checkpoint(new_dir) == own


def test_the_training_finished_mark(tmp_path):
  train_dir = str(tmp_path)
  assert files.TrainingFinished(train_dir) is None
  files.MarkTrainingFinished(train_dir, 100, 200)
  assert files.TrainingFinished(train_dir) == (100, 200)
  files.ClearTrainingFinished(train_dir)
  assert files.TrainingFinished(train_dir) is None
  assert files.CheckpointStep(os.path.join(train_dir, 'ckpt-00000100')) == 100
  assert files.CheckpointStep(None) is None
