"""The trainer's step built ahead of its first run (prepared_step.py).

Run through the prepared callable, a step returns what Session.run returns
for Lingvo's [train_op, eval_metrics, per_example_tensors] and updates the
variables the same way, step after step.
"""

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np

from lingvo_ext.runtime import prepared_step
from lingvo_ext.tasks import experiment_params
from tests.support import gpipe_testlib


def _FakeTask():
  """A task's step: an update, (value, weight) metrics, per-example values."""
  w = tf.Variable([1.0, 2.0, 3.0])
  x = tf.constant([0.5, -1.0, 2.0])
  w_read = w.read_value()
  loss = tf.reduce_sum(w_read * x)
  # The values fetched are those before the step's update.
  with tf.control_dependencies([w_read, loss]):
    train_op = w.assign_sub(0.1 * x).op
  one = tf.constant(1.0)
  return py_utils.NestedMap(
      train_op=train_op,
      # The same tensor twice (a weight), as Lingvo's metrics often hold.
      eval_metrics=py_utils.NestedMap(loss=(loss, one), num=(one, one)),
      per_example_tensors=py_utils.NestedMap(w=w_read, xs={'x': x}))


def testPreparedStepReturnsWhatSessionRunReturns():
  with tf.Graph().as_default():
    task = _FakeTask()
    init = tf.global_variables_initializer()
    fetches = [task.train_op, task.eval_metrics, task.per_example_tensors]
    with tf.Session() as run_sess, tf.Session() as prepared_sess:
      run_sess.run(init)
      prepared_sess.run(init)
      step = prepared_step.Prepare(prepared_sess, task)
      assert step is not None and step.Matches(list(fetches))
      assert not step.Matches(fetches + [task.train_op])
      assert not step.Matches([task.train_op, dict(task.eval_metrics),
                               task.per_example_tensors])
      for _ in range(3):
        want, got = run_sess.run(fetches), step.Run()
        assert got[0] is None and want[0] is None
        assert type(got[1]) is type(want[1])  # pylint: disable=unidiomatic-typecheck
        assert sorted(got[1]) == sorted(want[1])
        for k in want[1]:
          assert isinstance(got[1][k], tuple)
          assert [type(v) for v in got[1][k]] == [type(v) for v in want[1][k]]
          assert got[1][k] == want[1][k], k
        np.testing.assert_array_equal(got[2].w, want[2].w)
        np.testing.assert_array_equal(got[2].xs['x'], want[2].xs['x'])
      # Both sessions' variables moved the same way, 3 steps.
      w = task.per_example_tensors.w
      np.testing.assert_array_equal(prepared_sess.run(w), run_sess.run(w))
      np.testing.assert_allclose(run_sess.run(w), [0.85, 2.3, 2.4], rtol=1e-6)


def testARegisteredExperimentsStepsEqualSessionRuns():
  """lm.TransformerLmTinyGPipe, 2 devices: 3 steps, two sessions, one graph."""
  params = experiment_params.GetParams('lm.TransformerLmTinyGPipe', 'Train')
  with tf.Graph().as_default(), gpipe_testlib.Cluster(2):
    tf.random.set_seed(0)
    model = params.Instantiate()
    model.ConstructFPropBPropGraph()
    task = model.GetTask()
    init = [tf.global_variables_initializer(), tf.local_variables_initializer(),
            tf.tables_initializer()]
    fetches = [task.train_op, task.eval_metrics, task.per_example_tensors]
    config = py_utils.SessionConfig()
    config.device_count['CPU'] = 2
    sessions = [tf.Session(config=config), tf.Session(config=config)]
    try:
      for sess in sessions:
        sess.run(init)
        task.input.Initialize(sess)
      step = prepared_step.Prepare(sessions[1], task)
      assert step is not None
      for _ in range(3):
        want, got = sessions[0].run(fetches), step.Run()
        assert sorted(got[1]) == sorted(want[1])
        for k in want[1]:
          assert got[1][k] == want[1][k], k
      assert sessions[0].run(task.global_step) == 3
      assert sessions[1].run(task.global_step) == 3
    finally:
      for sess in sessions:
        sess.close()


def testAStepPreparedBeforeTheGraphGrowsStepsAlike():
  """The trainer prepares its step before a controller sharing the model
  adds its checkpointer's ops (one_build.py), in a session on the local
  server as the trainer's: the session's graph grows under the callable,
  which must still step as Session.run does (here in a session of its own).
  """
  server = tf.distribute.Server.create_local_server()
  with tf.Graph().as_default():
    task = _FakeTask()
    init = tf.global_variables_initializer()
    fetches = [task.train_op, task.eval_metrics, task.per_example_tensors]
    with tf.Session() as run_sess, tf.Session(server.target) as prepared_sess:
      prepared_sess.run(init)
      step = prepared_step.Prepare(prepared_sess, task)
      assert step is not None
      # Ops added afterwards (a controller's saver), run in that session.
      copy = tf.Variable(tf.zeros([3]))
      save = copy.assign(task.per_example_tensors.w)
      run_sess.run([init, copy.initializer])
      prepared_sess.run(copy.initializer)
      np.testing.assert_array_equal(prepared_sess.run(save), [1.0, 2.0, 3.0])
      for _ in range(3):
        want, got = run_sess.run(fetches), step.Run()
        assert got[1] == want[1]
        np.testing.assert_array_equal(got[2].w, want[2].w)
      w = task.per_example_tensors.w
      np.testing.assert_array_equal(prepared_sess.run(w), run_sess.run(w))
      np.testing.assert_allclose(run_sess.run(w), [0.85, 2.3, 2.4], rtol=1e-6)
      np.testing.assert_array_equal(prepared_sess.run(save), run_sess.run(w))
