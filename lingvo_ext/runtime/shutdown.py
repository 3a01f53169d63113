"""SIGTERM, SIGHUP and SIGINT: a request to stop safely, with a deadline.

Clusters stop a job with SIGTERM and, after a grace period, SIGKILL
(Kubernetes' terminationGracePeriodSeconds, Slurm's KillWait or
--signal). A trainer process treats the first SIGTERM, SIGHUP or SIGINT as
a request to stop: `RunState.interrupted` is set, the trainer stops after
its step, the controller saves the current step, evalers and decoders
finish the checkpoint they are on, and the process exits. A second signal,
or --shutdown_grace_secs after the first, exits at once: the `checkpoint`
state file still names the last complete checkpoint (the savers write it
only after a checkpoint's files are whole).

The signals are read by a thread of their own (signal.set_wakeup_fd): the
main thread may be blocked in a session call, where a Python signal
handler would run only after it returns.

Exit codes (docs/preemption.md):
  0   stopped on SIGTERM/SIGHUP, the current step saved (or nothing to save);
      --preempted_exit_code in place of 0 where given, so that a cluster
      that restarts failed tasks only (a Kubernetes Job) restarts this one;
  130 stopped on Ctrl-C, the current step saved;
  143 SIGTERM/SIGHUP: the deadline or a second signal came first; the last
      complete checkpoint is the latest.
"""

import os
import signal
import socket
import sys
import threading

from lingvo_ext._internal import process

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
EXIT_STOPPED = 0
EXIT_INTERRUPTED = 130
EXIT_NOT_SAVED = 143
# Codes with a meaning of their own (docs/preemption.md): not a preempted
# run's status.
RESERVED_CODES = (1, 2, 3, 65, 74, 130, 137, EXIT_NOT_SAVED)


def ExitCode(signum, saved, preempted=EXIT_STOPPED):
  """The exit code after stop signal `signum`; `saved`: the final save.

  `preempted`: the code of a SIGTERM/SIGHUP stop whose save is done
  (--preempted_exit_code).
  """
  if signum == signal.SIGINT:
    return EXIT_INTERRUPTED
  return preempted if saved else EXIT_NOT_SAVED


def CheckPreemptedCode(code):
  """An error message for a bad --preempted_exit_code, or None."""
  if 0 <= code <= 255 and code not in RESERVED_CODES:
    return None
  return (f'--preempted_exit_code={code} must be 0-255 and none of '
          f'{", ".join(map(str, RESERVED_CODES))} (codes with their own '
          'meaning), e.g. 75.')


def Name(signum):
  return 'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name


class StopOnSignals:
  """Turns SIGTERM/SIGHUP/SIGINT into `run_state`'s stop request.

  Args:
    run_state: runners.RunState; `interrupted` is set by the first signal,
      `stop_signal` records it, `final_save` tells whether the owner of
      the checkpoints saved the last step.
    grace_s: Seconds from the first signal to the exit at once.
    nothing_to_save: Called at the first signal; returns a one-line reason
      to exit 0 at once (no checkpoint exists yet), or None.
    last_checkpoint: Returns the latest checkpoint's path (for messages).
    owns_checkpoints: Whether this process saves the checkpoints; a process
      that does not (a worker, an evaler) exits 0 at the deadline too.
    on_stop: Called (from the reader thread) after the first signal.
    preempted_code: The exit code of a SIGTERM/SIGHUP stop that lost
      nothing (--preempted_exit_code).
  """

  def __init__(self, run_state, grace_s, nothing_to_save=lambda: None,
               last_checkpoint=lambda: None, owns_checkpoints=True,
               on_stop=None, exit_now=process.ExitNow,
               preempted_code=EXIT_STOPPED):
    self._state = run_state
    self._preempted_code = preempted_code
    self._owns = owns_checkpoints
    self._on_stop = on_stop
    self._grace_s = grace_s
    self._nothing_to_save = nothing_to_save
    self._last_checkpoint = last_checkpoint
    self._exit_now = exit_now
    self._reader = None

  def Install(self):
    """From the main thread: signals go to this object from now on."""
    self._reader, writer = socket.socketpair()
    writer.setblocking(False)
    for s in SIGNALS:
      # A Python handler must be set for the wakeup fd to get the signal.
      signal.signal(s, lambda *unused: None)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    self._writer = writer  # Kept open for the process's life.
    threading.Thread(target=self._Read, daemon=True,
                     name='StopOnSignals').start()

  def _Read(self):
    while True:
      data = self._reader.recv(64)
      if not data:
        return
      for signum in data:
        self.Handle(signum)

  def _Say(self, line):
    print(line, file=sys.stderr, flush=True)

  def Handle(self, signum):
    """What a stop signal does (the reader thread calls it)."""
    state = self._state
    if signum not in SIGNALS:
      return
    if state.interrupted.is_set() and not state.stop_signal:
      # The input broke (input_guard.py): already saving, then exiting.
      state.stop_signal = signum
      self._Say(f'{Name(signum)}: already stopping safely (the input broke): '
                'saving the current step, then exiting.')
      return
    if state.interrupted.is_set():
      first = state.stop_signal or signum
      self._Say(f'\n{Name(signum)} again: exiting at once, without the final '
                f'checkpoint; the last checkpoint is {self._last_checkpoint()}.')
      self._exit_now(ExitCode(first, not self._owns, self._preempted_code))
      return
    state.stop_signal = signum
    reason = self._nothing_to_save()
    if reason:
      self._Say(f'{Name(signum)}: {reason}; exiting.')
      self._exit_now(ExitCode(signum, True, self._preempted_code))
      return
    state.interrupted.set()
    if signum == signal.SIGINT:
      self._Say('\ninterrupted: saving a checkpoint, then exiting (Ctrl-C '
                'again to exit at once).')
    else:
      self._Say(f'{Name(signum)}: stopping safely: saving the current step, '
                f'then exiting (at most {self._grace_s:g} s, '
                '--shutdown_grace_secs; a second signal exits at once).')
    timer = threading.Timer(self._grace_s, self._Deadline, args=(signum,))
    timer.daemon = True
    timer.start()
    if self._on_stop:
      self._on_stop()

  def _Deadline(self, signum):
    saved = self._state.final_save.is_set() or not self._owns
    if not saved:
      self._Say(f'{Name(signum)}: not done within --shutdown_grace_secs='
                f'{self._grace_s:g}: exiting without the final checkpoint; '
                f'the last checkpoint is {self._last_checkpoint()}.')
    self._exit_now(ExitCode(signum, saved, self._preempted_code))


def SetTitle(title):
  """This process's title, as ps, top and pgrep show it."""
  try:
    import setproctitle  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  setproctitle.setproctitle(title)


def TaskTitle(jobs, task, logdir, distributed):
  """`lingvo_ext controller.0 /logdir` (a local run: `lingvo_ext local`)."""
  name = ','.join(jobs)
  if distributed:
    name = f'{name}.{task}'
  return f'lingvo_ext {name} {os.path.abspath(logdir) if logdir else ""}'.strip()
