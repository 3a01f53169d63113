"""Lingvo's Checkpointer for lingvo_ext (checkpoints/checkpointers.py).

Restores across cuts: tests/pipeline/test_checkpoint_cuts.py; the trainer's
finite saves end to end: tests/e2e/test_trainer_safety.py.
"""

import numpy as np
import tensorflow as tf

from lingvo_ext import checkpoints
from lingvo_ext.checkpoints import checkpointers
from lingvo_ext.checkpoints import files
from lingvo_ext.checkpoints import reader


def test_finite_checks_name_the_variables_holding_nan_or_inf():
  with tf.Graph().as_default():
    good = tf.compat.v1.get_variable('good', initializer=np.ones([2, 3],
                                                                 np.float32))
    bad = tf.compat.v1.get_variable('bad', initializer=np.float32([1, np.inf]))
    steps = tf.compat.v1.get_variable('steps', initializer=np.int64(3))
    checks = checkpointers.FiniteChecks([good, bad, steps])
    # Float variables only.
    assert [name for name, _ in checks] == ['good', 'bad']
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      assert checkpointers.NonFiniteVariables(sess, checks) == ['bad']
      sess.run(bad.assign([1., 2.]))
      assert checkpointers.NonFiniteVariables(sess, checks) == []
    assert checkpointers.NonFiniteVariables(None, []) == []


def test_the_package_keeps_every_public_name():
  for module in (files, checkpointers, reader):
    for name in dir(module):
      if name[0].isupper() and getattr(module, name).__module__ == (
          module.__name__):
        assert getattr(checkpoints, name) is getattr(module, name), name
