"""One build of the model per trainer process (runtime/one_build.py).

The in-process controller shares the trainer's graph and model: the task's
forward pass is built once per process, the checkpoints hold the same keys
and values as with Lingvo's two builds, and the controller's train summaries
are still written, fetched with a training step.
"""

import glob
import os
import subprocess
import sys

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.runtime import local_trainer
from lingvo_ext.runtime import one_build
from tests.support import ROOT
from tests.support import zygote

TIMEOUT = 300
GPIPE = ['--num_cpu_devices=2', '--worker_split_size=2']

# An experiment whose task notes each build of its forward pass (the pid of
# the process that built it) in the file $BUILDS_FILE.
_EXPERIMENT = '''
import os

from lingvo import model_registry
from lingvo_ext.tasks.lm import model

from params import lm


class CountedLm(model.TransformerLm):
  """TransformerLm noting each build of its forward pass."""

  def FPropDefaultTheta(self, *args, **kwargs):
    with open(os.environ['BUILDS_FILE'], 'a') as f:
      f.write('%d\\n' % os.getpid())
    return super().FPropDefaultTheta(*args, **kwargs)


@model_registry.RegisterSingleTaskModel
class CountedLmTinyGPipe(lm.TransformerLmTinyGPipe):

  def Task(self):
    p = super().Task()
    p.cls = CountedLm
    return p
'''

# Lingvo's two builds: the controller builds its own model; the trainer's
# steps go through Session.run (no step built ahead, prepared_step.py).
_TWO_BUILDS = (
    'import sys\n'
    'from lingvo_ext import trainer\n'
    'from lingvo_ext.runtime import local_trainer, runners\n'
    'runners.RunnerManager._SharesModel = lambda self, jobs: False\n'
    'local_trainer._TrainerSession.PrepareStep = lambda self, task: None\n'
    'sys.exit(trainer.Run(["trainer"] + sys.argv[1:]))\n')


def _Builds(path):
  with open(path) as f:
    return [int(line) for line in f.read().split()]


def _Train(tmp_path, name, two_builds=False):
  """Trains 3 steps; returns (logdir, the pids of the forward builds)."""
  logdir = str(tmp_path / name)
  builds = str(tmp_path / f'{name}.builds')
  env = dict(os.environ, BUILDS_FILE=builds,
             PYTHONPATH=os.pathsep.join([str(tmp_path / 'exp'), ROOT]))
  flags = ['--model=countexp.CountedLmTinyGPipe', f'--logdir={logdir}',
           '--max_steps=3'] + GPIPE
  cmd = ([sys.executable, '-c', _TWO_BUILDS] if two_builds else
         [sys.executable, '-m', 'lingvo_ext.trainer'])
  proc = zygote.run(cmd + flags, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
  assert proc.returncode == 0, proc.stdout[-5000:]
  return logdir, _Builds(builds)


@pytest.mark.e2e
def test_one_build_saves_the_checkpoints_of_two(tmp_path):
  (tmp_path / 'exp').mkdir()
  (tmp_path / 'exp' / 'countexp.py').write_text(_EXPERIMENT)
  one, one_builds = _Train(tmp_path, 'one')
  two, two_builds = _Train(tmp_path, 'two', two_builds=True)
  # One process each; Lingvo's controller built the forward pass again.
  assert len(set(one_builds)) == 1 and len(one_builds) == 1, one_builds
  assert len(set(two_builds)) == 1 and len(two_builds) == 2, two_builds
  for step in (0, 3):
    a = tf.train.load_checkpoint(f'{one}/train/ckpt-0000000{step}')
    b = tf.train.load_checkpoint(f'{two}/train/ckpt-0000000{step}')
    keys = a.get_variable_to_shape_map()
    assert keys == b.get_variable_to_shape_map()
    assert any('/emb/' in k for k in keys) and 'global_step' in keys
    for k in keys:
      np.testing.assert_array_equal(a.get_tensor(k), b.get_tensor(k), k)
  # The controller's files are its own, as with its own build.
  for name in ('params.txt', 'model_analysis.txt'):
    with open(os.path.join(one, 'control', name)) as f:
      text = f.read()
    with open(os.path.join(two, 'control', name)) as f:
      assert text == f.read().replace(two, one), name
  assert glob.glob(os.path.join(one, 'control', 'events.out.*'))
  # One ran its steps through the step built ahead (prepared_step.py), two
  # through Session.run: the same checkpoints above.
  logs = [os.path.join(d, 'log.controller+trainer_client.txt')
          for d in (one, two)]
  built = 'Built the training step ahead of its first run.'
  with open(logs[0]) as f:
    assert built in f.read()
  with open(logs[1]) as f:
    assert built not in f.read()


def test_a_requested_summary_comes_with_the_next_step_at_its_step():
  graph = tf.Graph()
  with graph.as_default():
    step = tf.train.get_or_create_global_step()
    x = tf.Variable(0.0, name='x')
    with tf.control_dependencies([x.assign_add(1.0)]):
      train_op = step.assign_add(1)
    tf.summary.scalar('x_summary', x.read_value())
    summary_op = tf.summary.merge_all()
    init = tf.global_variables_initializer()
  written = []
  summaries = one_build.TrainSummaries()
  summaries.Connect(summary_op, lambda s, at: written.append((at, s)))
  task = py_utils.NestedMap(train_op=train_op, global_step=step)
  model = py_utils.NestedMap(tasks=[task], global_step=step)
  session = local_trainer._TrainerSession  # pylint: disable=protected-access
  with session(graph=graph, model=model, summaries=summaries) as sess:
    sess.run(init)
    # Lingvo's trainer loop: the step's fetches, then the global step.
    assert len(sess.run([train_op, {}, {}])) == 3
    assert sess.run(step) == 1 and not written
    summaries.Request()
    assert len(sess.run([train_op, {}, {}])) == 3  # The summary taken off.
    assert sess.run(step) == 2
    assert sess.run(step) == 2 and len(written) == 1
    sess.run([train_op, {}, {}])
    assert sess.run(step) == 3 and len(written) == 1  # Once per request.
  at, summary = written[0]
  assert at == 2
  value, = tf.Summary.FromString(summary).value
  assert value.tag == 'x_summary' and value.simple_value in (1.0, 2.0)


@pytest.mark.e2e
def test_the_controller_still_writes_train_summaries(tmp_path):
  logdir = str(tmp_path / 'logdir')
  # The controller looks every second, so several times during the steps.
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer',
       '--model=lm.TransformerLmTiny', f'--logdir={logdir}', '--max_steps=100',
       '--model_params_override=train.save_interval_seconds:1'], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=TIMEOUT)
  assert proc.returncode == 0, proc.stdout[-5000:]
  tags = {}
  for path in glob.glob(os.path.join(logdir, 'control', 'events.out.*')):
    for event in tf.train.summary_iterator(path):
      for v in event.summary.value:
        tags.setdefault(event.step, set()).add(v.tag)
  trained = [s for s in tags if s >= 1]
  assert trained, tags
  # The model's merged summaries (a step's loss, gradients and variables).
  for step in trained:
    assert {'total_num_params', 'grad_norm/all/loss',
            'fprop/lm/num_predictions'} <= tags[step], tags[step]
    assert any(t.startswith('var_hist/') for t in tags[step]), tags[step]
