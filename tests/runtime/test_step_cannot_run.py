"""A training step that can never run stops the trainer with one line.

Lingvo's runner retries an InvalidArgumentError as transient; an XLA cell
holding an op XLA cannot compile would be built and failed again for
minutes (runtime/local_trainer.py, CannotRunLine).
"""

import os
import subprocess
import sys

import lingvo.compat as tf
import numpy as np
import pytest
import tensorflow as tf2

from lingvo_ext.runtime import local_trainer
from tests.support import ROOT
from tests.support import host_copy
from tests.support import zygote

TIMEOUT = 300

def _CompileError():
  """The error TensorFlow raises for an XLA function holding a PyFunc."""
  g = tf.Graph()
  with g.as_default():
    x = tf.placeholder(tf.float32, [3])
    fn = tf2.function(lambda x: tf.numpy_function(np.copy, [x], tf.float32),
                      jit_compile=True, autograph=False)
    y = fn(x)
  with tf.Session(graph=g) as sess:
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
      sess.run(y, {x: np.ones(3, np.float32)})
  return e.value


def test_a_cell_xla_cannot_compile_is_one_line_naming_the_fix():
  line = local_trainer.CannotRunLine('trainer', _CompileError())
  assert line.startswith('trainer: the training step cannot run: Detected '
                         'unsupported operations when trying to compile')
  assert 'PyFunc' in line and '\n' not in line
  assert line.endswith('build it without XLA (--jit_compile=False, or the '
                       "pipeline's jit_compile:False).")


def test_other_errors_are_not_such_a_step():
  assert local_trainer.CannotRunLine(
      'trainer', tf.errors.InvalidArgumentError(
          None, None, 'Tensor had NaN values')) is None
  assert local_trainer.CannotRunLine(
      'trainer', tf.errors.InvalidArgumentError(
          None, None, 'Error while reading resource variable x from '
          'Container: localhost. This could mean that the variable was '
          'uninitialized.')) is None


@pytest.mark.e2e
def test_trainer_stops_at_once_with_one_line(tmp_path):
  (tmp_path / 'host_copy_exp.py').write_text(host_copy.EXPERIMENT)
  logdir = tmp_path / 'logdir'
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer',
       '--model=host_copy_exp.HostCopyTiny', f'--logdir={logdir}',
       "--model_params_override=task.jit_compile:True"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, timeout=TIMEOUT)
  out = proc.stdout
  assert proc.returncode == local_trainer.EXIT_STEP_CANNOT_RUN, out[-3000:]
  errors = [l for l in out.splitlines() if l.startswith('error:')]
  assert len(errors) == 1, out[-3000:]
  assert errors[0].startswith(
      'error: trainer: the training step cannot run: Detected unsupported '
      'operations'), errors
  assert 'PyFunc' in errors[0] and '--jit_compile=False' in errors[0]
  assert 'Traceback' not in out
  # Built without XLA, the same model trains.
  proc = zygote.run(
      [sys.executable, '-m', 'lingvo_ext.trainer',
       '--model=host_copy_exp.HostCopyTiny', f'--logdir={tmp_path / "ok"}'],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, timeout=TIMEOUT)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert 'step 3/3' in proc.stdout
