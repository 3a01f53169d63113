"""The trainer's input: checked against its fingerprint; a fault saves first.

`CheckFingerprint`: at a logdir's first start the trainer records what it
trains on (tasks/input_fingerprint.py); on resume a changed input file is
one `warning:` line (--accept_changed_input records it and silences it), a
changed vocab a refusal.

Lingvo's record input files that break under a run (deleted, emptied,
binary: tasks/input_files.py) stop it with one `error:` line and exit 65
(EX_DATAERR). As on SIGTERM (shutdown.py), the trainer first stops after
its step in flight and the controller saves the step it stopped at: no
complete step is lost. A process without the checkpoints (a cluster's
trainer client) stops stepping and exits; the launcher then stops the
cluster, and its controller, which watches the files too, saves.
"""

import os
import sys
import threading

import lingvo.compat as tf

from lingvo_ext import checkpoints
from lingvo_ext._internal import process
from lingvo_ext.tasks import input_files
from lingvo_ext.tasks import input_fingerprint

EXIT_INPUT_BROKE = input_files.EXIT_INPUT_BROKE


class InputFault:
  """Stops a run whose input broke: save first, then one line and exit 65.

  Args:
    run_state: The process's runner_state.RunState.
    train_dir: The checkpoint directory.
    owns: Whether this process saves the checkpoints.
    grace_s: Seconds to wait for the save (--shutdown_grace_secs).
  """

  def __init__(self, run_state, train_dir, owns, grace_s,
               exit_now=process.ExitNow):
    self._state = run_state
    self._train_dir = train_dir
    self._owns = owns
    self._grace_s = grace_s
    self._exit_now = exit_now
    self._lock = threading.Lock()

  def _CanSave(self):
    state = self._state
    return self._owns and state.controller_here.is_set() and (
        state.first_save_done.is_set() or
        checkpoints.LatestCheckpoint(self._train_dir))

  def Stop(self, problem):
    """The watch's callback (its thread): stop after the step, save, exit."""
    state = self._state
    if not state.input_problem:
      state.input_problem = problem
      if not state.interrupted.is_set():
        state.interrupted.set()  # The trainer stops, the controller saves.
    self.Exit()

  def Exit(self):
    """After the save (or --shutdown_grace_secs): the error line, exit 65.

    The watch's thread and the main thread (once the runners returned) both
    call it; the first one ends the process.
    """
    state = self._state
    with self._lock:
      if self._CanSave():
        state.final_save.wait(self._grace_s)
      elif not self._owns:
        state.trainer_done.wait(self._grace_s)  # Its step in flight.
      latest = checkpoints.LatestCheckpoint(self._train_dir) or 'none yet'
      saved = ('the current step was saved, ' if state.final_save.is_set()
               else '' if self._owns else
               'the controller saves the step it stopped at; so far ')
      tf.logging.error('%s', state.input_problem)
      tf.logging.flush()
      sys.stdout.flush()
      print(f'error: {state.input_problem}: Lingvo\'s reader would wait for '
            'records forever or read it as text. Put the data back and run '
            f'the same command ({saved}the last checkpoint is {latest}).',
            file=sys.stderr, flush=True)
      self._exit_now(EXIT_INPUT_BROKE)


def Watch(o, cfg, run_state):
  """Watches the training input's record files (tasks/input_files.py).

  Returns:
    The InputFault that stops the run, or None when nothing is watched.
  """
  if not (o.trains_here or 'trainer_client' in o.jobs) or not o.logdir:
    return None
  fault = InputFault(run_state, os.path.join(o.logdir, 'train'),
                     o.trains_here, o.shutdown_grace_secs)
  if input_files.StartWatch(cfg.input if 'input' in cfg else None,
                            fault.Stop) is None:
    return None
  return fault


def CheckFingerprint(o, cfg):
  """Compares the training input with the logdir's record; records it.

  Returns:
    The refusal of a changed vocab (one line: exit 2), or None; a changed
    input file is printed as one warning line.
  """
  train_dir = os.path.join(o.logdir, 'train')
  inp = cfg.input if 'input' in cfg else None
  current = input_fingerprint.Current(inp, o.logdir)
  recorded = input_fingerprint.Read(train_dir)
  if recorded is not None:
    warning, refusal = input_fingerprint.Compare(recorded, current)
    if refusal:
      return refusal
    if warning and not o.accept_changed_input:
      print(f'warning: {warning}', file=sys.stderr, flush=True)
  elif not current['files'] and not current['vocab']:
    return None  # Nothing on disk to record (e.g. the bundled corpus).
  os.makedirs(train_dir, exist_ok=True)
  input_fingerprint.Write(train_dir, input_fingerprint.Updated(
      recorded, current, o.accept_changed_input))
  return None
