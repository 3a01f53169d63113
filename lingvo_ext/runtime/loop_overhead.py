"""The trainer loop's own time per step, probed: what a step costs besides
the step's Session.run.

Lingvo's trainer loop (and this project's around it) runs, per training
step, the step itself and then: a Session.run for the global step before and
two after it, a scalar summary per step rate and per metric to the train
summary writer, a log line, and the progress line's bookkeeping. None of it
is the plan's, so the planner's step (a bare Session.run of the train op,
planner/calibration.py) leaves it out; the plan check's measured step (one
_OnStep to the next) has it. `Seconds` times that work alone, in this
process, on as many CPU devices and intra-op threads as the trainer, and
plan_prediction.py adds it as a term of the predicted step.
"""

import logging
import os
import statistics
import tempfile
import time

# Session.run calls per step beside the step's own (Trainer._Loop: the global
# step before the step and after it, twice).
SESSION_CALLS = 3
# Scalar summaries per step: step rate, example rate, total samples, and a
# typical task's metrics (loss, log_pplx, num_samples_in_batch, ...).
SUMMARIES = 7
# Timed iterations (the median is taken, as the plan check's step).
ROUNDS = 60


def Seconds(num_devices: int = 1, rounds: int = ROUNDS) -> float:
  """The median seconds of one step's loop work on this host now (TF)."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from lingvo_ext import session_config  # pylint: disable=g-import-not-at-top
  graph = tf.Graph()
  with graph.as_default():
    step = py_utils.GetOrCreateGlobalStepVar()
    init = tf.global_variables_initializer()
  with tempfile.TemporaryDirectory(prefix='loop_overhead.') as tmp:
    log = logging.getLogger('lingvo_ext.loop_overhead')
    log.propagate = False
    handler = logging.FileHandler(os.path.join(tmp, 'log.txt'))
    log.addHandler(handler)
    with graph.as_default():  # FileWriter's v1 API, not eager.
      writer = tf.summary.FileWriter(tmp)
    sess = tf.Session(graph=graph,
                      config=session_config.LocalSessionConfig(num_devices))
    times = []
    try:
      sess.run(init)
      for _ in range(rounds + 2):
        t = time.perf_counter()
        for _ in range(SESSION_CALLS):
          value = int(sess.run(step))
        for i in range(SUMMARIES):
          writer.add_summary(tf.Summary(value=[tf.Summary.Value(
              tag='loop_%d' % i, simple_value=float(i))]), value)
        log.info('step:%6d, steps/sec: %0.2f, examples/sec: %0.2f loss:%.8g',
                 value, 1., 1., 1.)
        times.append(time.perf_counter() - t)
    finally:
      sess.close()
      writer.close()
      log.removeHandler(handler)
      handler.close()
  return statistics.median(times[2:])
