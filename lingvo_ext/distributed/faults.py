"""Fault reporting: which task of the cluster a failed step lost.

Runners mix in `LostTaskReportMixin`: when Lingvo retries a step (or gives
up) after an UnavailableError or a deadline, one line names the lost task,
its device and address, and what happens next; the error records that
follow it go to the task's log file only (`KeepFaultRecordsInLogFile`).
"""

import logging
import re
import sys
import threading

import lingvo.compat as tf
from lingvo.core import py_utils
from tensorflow.core.protobuf import config_pb2

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import server

_SERVER_JOBS = server.SERVER_JOBS


def SilentTasks(jobs, timeout_s=5.0):
  """['worker task 1', ...]: server tasks that do not answer within timeout_s.

  A hung task (stopped, swapping) still accepts TCP connections, so this asks
  each task's TensorFlow server for its devices, with a deadline.
  """
  answered = set()
  tasks = [(j, t, a) for j, addrs in jobs.items() if j in _SERVER_JOBS
           for t, a in enumerate(addrs)]

  def Probe(job, task, address):
    config = config_pb2.ConfigProto(
        operation_timeout_in_ms=int(timeout_s * 1000))
    config.device_filters.append(f'/job:{job}/replica:0/task:{task}')
    try:
      with tf.Session(f'grpc://{address}', graph=tf.Graph(),
                      config=config) as sess:
        sess.list_devices()
      answered.add((job, task))
    except Exception:  # pylint: disable=broad-except
      pass

  threads = [threading.Thread(target=Probe, args=x, daemon=True)
             for x in tasks]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout_s + 5)
  return [(j, t) for j, t, _ in tasks if (j, t) not in answered]


class _NamesLostTasksOnExit:
  """A session whose `with` block names a lost task as the block fails.

  tf.Session's own exit then closes the session, which waits on the lost
  task for as long again (--worker_timeout_secs): the line comes first.
  """

  def __init__(self, sess, report):
    self._sess = sess
    self._report = report

  def __enter__(self):
    return self._sess.__enter__()

  def __exit__(self, exc_type, exc_value, exc_tb):
    if exc_value is not None:
      # Lingvo retries the errors it deems transient (base_runner._RunLoop).
      self._report(exc_value,
                   isinstance(exc_value, py_utils.transient_tf_errors))
    return self._sess.__exit__(exc_type, exc_value, exc_tb)

  def __getattr__(self, name):
    return getattr(self._sess, name)


class LostTaskReportMixin:
  """Runners say in one line which task they lost when a step fails.

  The runner has `self._options` (trainer_flags.Options). The line is said
  once per error: as the session's block fails (`NamingLostTasks`), or
  from Lingvo's status message.
  """

  _reported_error = None

  def NamingLostTasks(self, sess):
    """`sess`, which names a lost task as soon as its `with` block fails."""
    if not self._options.distributed:
      return sess
    return _NamesLostTasksOnExit(sess, self._ReportLostTask)

  def _SetStatusMessage(self, message, retrying=False):
    super()._SetStatusMessage(message, retrying=retrying)
    # Lingvo calls this from its except block, so the error is at hand.
    self._ReportLostTask(sys.exc_info()[1], retrying)

  def _ReportLostTask(self, error, retrying):
    """Says the line for `error` once; whether it said one that ends the job."""
    deadline = isinstance(error, tf.errors.DeadlineExceededError)
    o = self._options
    if not (o.distributed and (retrying or deadline) and isinstance(
        error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError))):
      return False
    if error is self._reported_error:
      return False
    self._reported_error = error
    print(LostTaskLine(o, error, retrying), file=sys.stderr, flush=True)
    if not getattr(o, 'stderrthreshold', ''):
      self._KeepErrorsInLogFile()
      KeepFaultRecordsInLogFile()
    return not retrying

  def _KeepErrorsInLogFile(self):
    """Sends the log's errors to its file only (the runtime's runners know
    where the log goes: runner_state.RunnerMixin)."""


class _BelowErrors(logging.Filter):
  """Lets only records below ERROR through."""

  def filter(self, record):
    return record.levelno < logging.ERROR


_BELOW_ERRORS = _BelowErrors()


def KeepFaultRecordsInLogFile():
  """After a lost task's line: the error records that follow it (Lingvo's
  traceback of the step, TensorFlow's 'Session failed to close') go to the
  task's log file only, not the console. Also TensorFlow's own stderr
  handler, which its logger has where no root handler was set up first
  (absl's handler is the runner's `_KeepErrorsInLogFile`)."""
  for handler in logging.getLogger('tensorflow').handlers:
    if (isinstance(handler, logging.StreamHandler) and
        getattr(handler, 'stream', None) in (sys.stderr, sys.__stderr__) and
        _BELOW_ERRORS not in handler.filters):
      handler.addFilter(_BELOW_ERRORS)


def LostTaskLine(options, error, retrying):
  """'JOB: lost contact with worker task 1 (...); retrying.' for `error`."""
  message = str(error)
  deadline = isinstance(error, tf.errors.DeadlineExceededError)
  tasks = re.findall(r'remote target (/job:\w+/replica:\d+/task:\d+)',
                     message)
  me = f'/job:{options.jobs[0]}/replica:0/task:{options.task}'
  if not tasks:  # E.g. a deadline: name the tasks the error mentions.
    tasks = [t for t in re.findall(r'/job:\w+/replica:\d+/task:\d+', message)
             if t != me]
  jobs = cluster.ParseClusterSpec(options.cluster_spec)
  if not tasks and deadline:  # A hung task: ask each one.
    tasks = [f'/job:{j}/replica:0/task:{t}' for j, t in SilentTasks(jobs)]
    tasks = [t for t in tasks if t != me]
  names = []
  for t in sorted(set(tasks)):
    job, task = cluster.TaskOfDevice(t).split(' task ')
    address = jobs[job][int(task)] if job in jobs else '?'
    names.append(f'{job} task {task} ({t} at {address})')
  kind = type(error).__name__
  then = ('retrying (Lingvo restores the last checkpoint once it is back)'
          if retrying else 'exiting (lingvo_ext.launch restarts this '
          'process; on your own hosts, re-run its command)')
  return (f'{options.job}: lost contact with '
          f'{", ".join(names) or "a task of the cluster"} ({kind}); {then}.')
