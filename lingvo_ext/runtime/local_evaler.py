"""The trainer's evaler and decoder: they stop after training's last checkpoint.

Lingvo's Evaler and Decoder, which process the trainer's checkpoints as they
come, say what they wait for, print each result, and stop after the last
checkpoint of training as the trainer defines it (training_end.py).
"""

import os
import re
import sys
import time
import traceback

from lingvo import runners as lingvo_runners
import lingvo.compat as tf
from lingvo.core import py_utils

from lingvo_ext import checkpoints
from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext.runtime import disk_space
from lingvo_ext.runtime import progress
from lingvo_ext.runtime import runner_state
from lingvo_ext.runtime import training_end

# Seconds between two looks for a new checkpoint of an evaler or decoder.
CHECKPOINT_POLL_S = 1.0
# The exit status of an evaler or decoder whose evaluation failed.
EVAL_FAILED = 4
# Errors Lingvo retries for (a task of the cluster restarting).
_TRANSIENT = py_utils.transient_tf_errors + (
    tf.errors.AbortedError, tf.errors.CancelledError, tf.errors.DataLossError)


def _Cause(e):
  """The line of an error that says what went wrong (TensorFlow's graph
  errors wrap it in 'Graph execution error:', the node's stack, and counts
  of root errors)."""
  text = str(getattr(e, 'message', e))
  root = re.search(r'^\s*\(0\) [A-Z_]+: (.+)$', text, re.M)
  if root:
    return root.group(1).strip()
  skip = re.compile(r'Graph execution error|Detected at node|Node:|Original '
                    r'stack trace|Stack trace|From /job|\d+ (root error|'
                    r'successful operation|derived error)')
  lines = [line.strip() for line in text.split('\n')
           if line.strip() and not line[0].isspace() and
           not skip.match(line)]
  return lines[-1] if lines else runner_state.FirstLine(e)


class _WaitsForCheckpointsMixin:
  """An evaler or decoder that finishes, and says what it waits for.

  It processes the trainer's checkpoints as they come and stops after the
  last one of training: the checkpoint of the trainer's recorded max_steps,
  or the one the controller's `training_finished` file names
  (training_end.py), whatever --max_steps the trainer ran with. Each result
  is printed on stdout. A graph that fails to build stops the process with
  one `error:` line and EVAL_FAILED too.
  """

  def __init__(self, dataset, *args, **kwargs):
    try:
      super().__init__(dataset, *args, **kwargs)
      if self._options.eval_one_pass:  # A fresh input read once.
        internal_lingvo.SkipInputReset(self._task.input)
    except Exception as e:  # pylint: disable=broad-except
      if disk_space.IsDiskFull(e):
        raise  # StopOnDiskFullMixin's line and exit.
      kind = ('decoder' if isinstance(self, lingvo_runners.Decoder) else
              'evaler')
      job = getattr(self, '_job_name', None) or f'{kind}_{dataset}'
      progress.LogToFileOnly(traceback.format_exc())
      runner_state.Fail(
          f'{job}: building its graph for the {dataset} input failed: '
          f'{type(e).__name__}: {_Cause(e)}; the trace is in the log file '
          'the first line names; fix the model or its params and run it '
          'again.', EVAL_FAILED)

  def _End(self):
    if not hasattr(self, '_end'):
      self._end = training_end.End(
          self._job_name, self._checkpointer.checkpoint_dir,
          self._options.max_steps, self.params.train.max_steps,
          quiet=self._run_state.controller_here.is_set())
    return self._end

  def _ShouldStop(self, sess=None, step=None, check_early_stop=True):
    """Lingvo's stops, at the trainer's end instead of the experiment's."""
    if self._OnceOnly():
      return super()._ShouldStop(sess, step, check_early_stop)
    if step is None:
      step = (py_utils.GetGlobalStep().numpy() if py_utils.IsEagerMode() else
              sess.run(py_utils.GetGlobalStep()))
    if step >= self._End().Step():
      return True
    # Lingvo's early stops and trials; its max_steps rule is the one above.
    return super()._ShouldStop(sess, -1, check_early_stop)

  def _Finished(self, path):
    """Whether training finished with checkpoint `path` as its last."""
    done = checkpoints.TrainingFinished(self._checkpointer.checkpoint_dir)
    step = checkpoints.CheckpointStep(path)
    return done is not None and step is not None and step >= done[0]

  def _TrainerFinished(self, sess=None):
    if self._OnceOnly():
      return False  # Evaluates the checkpoint, processed or not.
    train_dir = self._checkpointer.checkpoint_dir
    path = checkpoints.NewestIntactCheckpoint(train_dir)
    if self._Finished(path):
      runner_dir = getattr(self, '_eval_dir', None) or getattr(
          self, '_decoder_dir', None)
      if runner_dir and path in py_utils.GetProcessedCheckpoints(runner_dir):
        print(f'{self._job_name}: training finished at '
              f'{os.path.basename(path)}, which was processed already (see '
              f'{runner_dir}); nothing to do.', flush=True)
      return True
    return super()._TrainerFinished(sess)

  def _RunLoop(self, job_name, loop_func, loop_args=(), cleanup_func=None):
    """Lingvo's loop; an evaluation that fails stops the process with one
    `error:` line and EVAL_FAILED (Lingvo's retries would end the job
    silently, or never with --eval_once)."""

    def Checked(*args):
      try:
        return loop_func(*args)
      except Exception as e:  # pylint: disable=broad-except
        if self._run_state.interrupted.is_set() or (
            not self._OnceOnly() and isinstance(e, _TRANSIENT)):
          raise  # Lingvo retries (a restarting cluster).
        runner_state.Fail(self._FailureLine(e), EVAL_FAILED)

    return super()._RunLoop(job_name, Checked, loop_args, cleanup_func)

  def _FailureLine(self, e):
    """One line: the job, its dataset, the cause, the fix."""
    dataset = self._job_name.split('_', 1)[-1]
    try:
      name = f' ({self._task.input.params.name})'
    except AttributeError:
      name = ''
    # The log file only: absl would echo an error record on the console.
    progress.LogToFileOnly(traceback.format_exc())
    cause = _Cause(e)
    if self._options.eval_one_pass and 'not compatible with expected' in cause:
      fix = ('with --eval_one_pass, a bucket\'s last batch of fewer rows '
             'than its batch limit does not fit the model\'s static batch: '
             'give the set a size the bucket_batch_limit divides, or '
             'evaluate without --eval_one_pass')
    elif 'mismatch shape' in cause:
      fix = ('its batches differ from their static shape: give its buckets '
             'batch limits the model can split, see docs/troubleshooting.md')
    else:
      fix = ('the trace is in the log file the first line names; fix the '
             'input or the model and run it again')
    return (f'{self._job_name}: evaluating the {dataset} input{name} failed: '
            f'{type(e).__name__}: {cause}; {fix}.')

  def _Loop(self):
    try:
      super()._Loop()
    finally:
      self._DequeueThreadComplete()  # `stopped`: the manager waits for it.

  def _OnceOnly(self):
    o = self._options
    return o.eval_once or bool(o.eval_checkpoint)

  def _FindNewCheckpoint(self, sess=None, processed_ckpts=None):
    """The next checkpoint to process; None once training has finished."""
    if not hasattr(self, '_waiting'):
      self._waiting = runner_state.Waiting()
    processed = processed_ckpts or ()
    train_dir = self._checkpointer.checkpoint_dir
    if self._OnceOnly():
      if getattr(self, '_evaluated_once', False):
        return None
      self._evaluated_once = True
      path = (self._options.eval_checkpoint or
              checkpoints.NewestIntactCheckpoint(train_dir))
      if not path:
        print(f'{self._job_name}: --eval_once: no checkpoint in {train_dir}: '
              'nothing to evaluate.', file=sys.stderr, flush=True)
      return path
    while True:
      if self._run_state.interrupted.is_set():
        return None  # SIGTERM / Ctrl-C: between two checkpoints.
      if self._ShouldStop(sess, step=0):  # Lingvo's early stop.
        return None
      path = checkpoints.NewestIntactCheckpoint(train_dir)
      if path and path not in processed:
        return path
      if self._Finished(path):
        return None
      if self._run_state.controller_here.is_set():
        pass  # Training runs in this process: nothing to tell.
      elif not path:
        self._waiting.Say(
            'none', f'{self._job_name}: waiting for a first checkpoint in '
            f'{train_dir}: train with the same --logdir (or add '
            f'{self._job_name} to the trainer\'s --job).')
      elif not runner_state.TrainerRuns(os.path.dirname(train_dir)):
        self._waiting.Say(
            'gone', f'{self._job_name}: done with {path}; no trainer runs on '
            f'this logdir (nothing holds its {runner_state.TRAINER_LOCK}): '
            'waiting for new checkpoints (--eval_once evaluates the newest '
            'and exits).',
            once=True)
      else:
        self._waiting.Say(
            path, f'{self._job_name}: done with {path}; waiting for a newer '
            f'checkpoint in {train_dir} ({self._End().Says()}, or at '
            'training_finished).')
      time.sleep(CHECKPOINT_POLL_S)

  def _WriteSummaries(self, summary_writer, job_name, global_step, summaries,
                      text_filename=None):
    # The text file is written whole or not at all (a stop at the deadline
    # leaves no partial file under its final name).
    temp = text_filename and f'{text_filename}.tmp{os.getpid()}'
    super()._WriteSummaries(summary_writer, job_name, global_step, summaries,
                            temp)
    if temp and tf.io.gfile.exists(temp):
      tf.io.gfile.rename(temp, text_filename, overwrite=True)
    values = []
    for unused_name, summary in sorted(summaries.items()):
      for value in getattr(summary, 'value', ()):
        if value.HasField('simple_value'):
          values.append(f'{value.tag} {value.simple_value:.4g}')
    print(f'{self._job_name}: step {int(global_step)}  ' + '  '.join(values),
          flush=True)
    self._SayIfNotOnePass(summaries)

  def _SayIfNotOnePass(self, summaries):
    """One line, once, when the examples scored are not the input's."""
    total = [v.simple_value for v in getattr(
        summaries.get('total_samples'), 'value', ())]
    size = self._task.input.params.num_samples
    if (not total or not size or int(total[0]) == size or
        self._options.eval_one_pass or getattr(self, '_said_samples', False)):
      return
    self._said_samples = True
    dataset = self._job_name.split('_', 1)[-1]
    print(f'note: {self._job_name}: scored {int(total[0])} examples; the '
          f'{dataset} input has {size} (input.num_samples). Lingvo scores '
          'whole batches until samples_per_summary, in the order it reads, '
          'so some examples may count twice and others not at all; '
          '--eval_once --eval_one_pass scores each once.', flush=True)


class LocalEvaler(runner_state.RunnerMixin, _WaitsForCheckpointsMixin,
                  lingvo_runners.Evaler):
  pass


class LocalDecoder(runner_state.RunnerMixin, _WaitsForCheckpointsMixin,
                   lingvo_runners.Decoder):
  """Lingvo's Decoder; a task with no decoder metrics says so, once."""

  def DecodeCheckpoint(self, sess, checkpoint_path):
    if not self._task.CreateDecoderMetrics():
      if not getattr(self, '_said_no_decoder', False):
        self._said_no_decoder = True
        print(f'{self._job_name}: {self._task.params.name} '
              f'({type(self._task).__name__}) has no decoder (its '
              'CreateDecoderMetrics is empty): nothing to decode; '
              f'--job=evaler_{self._job_name.split("_")[-1]} evaluates its '
              'loss.', flush=True)
      return
    return super().DecodeCheckpoint(sess, checkpoint_path)
