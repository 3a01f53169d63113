"""The trainer's input (runtime/input_guard.py): a fault mid-run saves the
step first, then one line and exit 65; a signal meanwhile keeps the save."""

import signal
import threading
import time
import types

from lingvo_ext.runtime import input_guard
from lingvo_ext.runtime import runners
from lingvo_ext.runtime import shutdown
from lingvo_ext.runtime import trainer_flags


def _Fault(tmp_path, owns=True, grace_s=300):
  state, codes = runners.RunState(), []
  fault = input_guard.InputFault(state, str(tmp_path), owns, grace_s,
                                 exit_now=codes.append)
  return state, fault, codes


def testAFaultStopsTheTrainerWaitsForTheSaveThenExits65(tmp_path, capsys):
  state, fault, codes = _Fault(tmp_path)
  state.controller_here.set()
  state.first_save_done.set()
  stop = threading.Thread(target=fault.Stop, args=('input: x was deleted',))
  stop.start()
  deadline = time.monotonic() + 60
  while not state.interrupted.is_set():  # The trainer stops, the
    assert time.monotonic() < deadline  # controller saves.
    time.sleep(0.01)
  time.sleep(0.2)
  assert not codes  # Not before the save.
  state.final_save.set()
  stop.join(60)
  assert codes == [65]
  assert capsys.readouterr().err.splitlines() == [
      "error: input: x was deleted: Lingvo's reader would wait for records "
      'forever or read it as text. Put the data back and run the same '
      'command (the current step was saved, the last checkpoint is none '
      'yet).']


def testBeforeTheFirstSaveAFaultExitsAtOnce(tmp_path, capsys):
  state, fault, codes = _Fault(tmp_path)
  state.controller_here.set()
  fault.Stop('input: x was deleted')
  assert codes == [65]
  assert 'the current step was saved' not in capsys.readouterr().err


def testAProcessWithoutTheCheckpointsExitsAfterItsStep(tmp_path, capsys):
  state, fault, codes = _Fault(tmp_path, owns=False)
  state.trainer_done.set()
  fault.Stop('input: x was deleted')
  assert codes == [65]
  assert ('(the controller saves the step it stopped at; so far the last '
          'checkpoint is none yet).') in capsys.readouterr().err


def testASignalDuringTheFaultsSaveDoesNotCutIt():
  state, codes = runners.RunState(), []
  stop = shutdown.StopOnSignals(state, 300, exit_now=codes.append)
  state.input_problem = 'input: x was deleted'
  state.interrupted.set()
  stop.Handle(signal.SIGTERM)  # The launcher stopping the cluster.
  assert not codes
  stop.Handle(signal.SIGTERM)  # A second one: at once.
  assert codes == [143]


def _Controller(distributed):
  state = runners.RunState()
  controller = object.__new__(runners.LocalController)
  # pylint: disable=protected-access
  controller._run_state, controller._woken = state, False
  controller._options = trainer_flags.Options(
      cluster_spec='controller=127.0.0.1:1' if distributed else '')
  return state, controller


def testAClustersControllerLooksAtOnceOnAStopRequest():
  state, controller = _Controller(distributed=True)
  threading.Timer(0.2, state.interrupted.set).start()
  look = threading.Thread(target=controller.WaitForNextLook,
                          args=(time.time() + 3600,), daemon=True)
  look.start()
  look.join(300)
  assert not look.is_alive()


class _SteppingSession:
  """A cluster's global step: the trainer client ends `more` steps."""

  def __init__(self, step, more):
    self.step, self.more = step, more

  def run(self, unused_fetch):
    if self.more:
      self.step, self.more = self.step + 1, self.more - 1
    return self.step


def testAClustersControllerSavesTheStepTheTrainerClientStoppedAt():
  # The client's step in flight ends after the controller woke.
  _, controller = _Controller(distributed=True)
  # pylint: disable=protected-access
  controller._model = types.SimpleNamespace(global_step='global_step')
  controller._looks = [(0.0, 100), (10.0, 300)]  # 50 ms a step.
  sess = _SteppingSession(583, more=2)
  assert controller._SettledStep(sess, 583) == 585
  controller._looks = [(0.0, 300), (10.0, 300)]  # No step between looks.
  assert controller._SettledStep(_SteppingSession(7, more=0), 7) == 7


def testALocalControllerWaitsForItsTrainersStepOnAStopRequest():
  # Its trainer stops after the step it is on: the save holds that step.
  state, controller = _Controller(distributed=False)
  state.interrupted.set()
  look = threading.Thread(target=controller.WaitForNextLook,
                          args=(time.time() + 3600,), daemon=True)
  look.start()
  look.join(1)
  assert look.is_alive()
  state.trainer_done.set()
  look.join(300)
  assert not look.is_alive()
