"""checkpoints.NewestIntactCheckpoint: the one reader of a logdir's
checkpoints (the trainer, evalers, export, convert_checkpoint, Predictor)."""

import os

import lingvo.compat as tf

from lingvo_ext import checkpoints


def _Save(train_dir, steps):
  with tf.Graph().as_default(), tf.Session() as sess:
    step = tf.train.get_or_create_global_step()
    tf.get_variable('w', initializer=tf.zeros([64]))
    saver = tf.train.Saver(max_to_keep=10)
    sess.run(tf.global_variables_initializer())
    for n in steps:
      sess.run(step.assign(n))
      saver.save(sess, os.path.join(train_dir, 'ckpt'), n)
  return [os.path.join(train_dir, f'ckpt-{n}') for n in steps]


def _Truncate(prefix):
  data = tf.io.gfile.glob(prefix + '.data-*')[0]
  with open(data, 'r+b') as f:
    f.truncate(os.path.getsize(data) // 2)


def testTheNewestIntactOneIsUsedAndEachDamagedOneNamedOnce(tmp_path,
                                                           capsys):
  train_dir = str(tmp_path)
  first, second, third = _Save(train_dir, [10, 20, 30])
  assert checkpoints.NewestIntactCheckpoint(train_dir) == third
  _Truncate(third)
  _Truncate(second)
  state = open(os.path.join(train_dir, 'checkpoint')).read()
  for _ in range(3):  # An evaler's polls: named once.
    assert checkpoints.NewestIntactCheckpoint(train_dir) == first
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 2, lines
  for line, bad in zip(lines, (third, second)):
    assert line.startswith(f'warning: skipped damaged checkpoint {bad} '
                           '(unreadable: '), line
    assert line.endswith(f'); using {first}.'), line
  # A reader leaves the trainer's state file as it is.
  assert open(os.path.join(train_dir, 'checkpoint')).read() == state


def testTheTrainerPointsTheStateFilePastTheDamagedOnes(tmp_path, capsys):
  train_dir = str(tmp_path)
  first, second = _Save(train_dir, [1, 2])
  _Truncate(second)
  assert checkpoints.NewestIntactCheckpoint(
      train_dir, none='nothing: starting afresh', repair=True) == first
  assert tf.train.latest_checkpoint(train_dir) == first
  _Truncate(first)
  assert checkpoints.NewestIntactCheckpoint(
      train_dir, none='nothing: starting afresh', repair=True) is None
  err = capsys.readouterr().err
  assert err.endswith(f'warning: skipped damaged checkpoint {first} '
                      f'(unreadable: {checkpoints.CheckpointProblem(first)}); '
                      'using nothing: starting afresh.\n'), err
  assert not os.path.exists(os.path.join(train_dir, 'checkpoint'))


def testAProblemIsReadOncePerVersionOfTheFiles(tmp_path, monkeypatch):
  train_dir = str(tmp_path)
  path, = _Save(train_dir, [5])
  reads = []
  real = checkpoints.CheckpointProblem
  monkeypatch.setattr(checkpoints.files, 'CheckpointProblem',
                      lambda p: reads.append(p) or real(p))
  for _ in range(3):
    assert checkpoints.ReadProblem(path) is None
  _Truncate(path)
  assert checkpoints.ReadProblem(path).startswith('unreadable: ')
  assert reads == [path, path], reads
