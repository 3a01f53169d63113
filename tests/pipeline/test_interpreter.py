"""Schedules run from their action lists (pipeline/interpreter.py): each
device runs its list in order, forwards first for a nonlinear loss, and a
list schedule refuses what it cannot run."""


import lingvo.compat as tf
from lingvo.core import py_utils
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import loss
from lingvo_ext.pipeline import schedules
from tests.pipeline import test_schedules
from tests.support import gpipe_testlib as lib

# --- Schedules run from their action lists -----------------------------------


def _ListGraph(schedule, num_cells, num_devices, num_micro, loss='sum'):
  cells = [gpipe.FeatureExtractionLayer.Params().Set(
      name='cell%d' % c, sub=[lib.Fc('fc%d' % c, 6, 6, seed=c + 1)])
           for c in range(num_cells)]
  g = tf.Graph()
  with g.as_default(), lib.Cluster(num_devices):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=num_micro,
        schedule=schedule).Instantiate()
    out = net.FPropDefaultTheta(tf.ones([4 * num_micro, 6]))
    loss_value = tf.reduce_sum(out if loss == 'sum' else out * out)
    tf.gradients(loss_value, net.vars.Flatten())
  return g


@pytest.mark.parametrize('schedule,num_cells,num_devices,num_micro', [
    ('zero_bubble', 2, 2, 4), ('zero_bubble', 3, 3, 5),
    ('zero_bubble', 4, 2, 3), ('interleaved_1f1b', 4, 2, 4)])
def test_each_device_runs_its_action_list_in_order(schedule, num_cells,
                                                   num_devices, num_micro):
  g = _ListGraph(schedule, num_cells, num_devices, num_micro)
  spec = schedules.StageSpec(num_cells, num_devices, num_micro)
  _AssertGatesFollow(g, schedules.Build(schedule, spec))


def _AssertGatesFollow(g, schedule):
  """Each action's gate in `g` waits for the action before it on its device."""
  gate_names = {'F': 'fwd_gate', 'B': 'bwd_gate', 'I': 'bwd_gate',
                'W': 'weight_grad/w_gate'}

  def Gate(a):
    suffix = 'cell%d_mb%d/%s' % (a.stage, a.micro_batch, gate_names[a.kind])
    found = [op for op in g.get_operations() if op.name.endswith(suffix)]
    assert len(found) == 1, (a, [op.name for op in found])
    return found[0]

  for device_actions in schedule:
    for prev, a in zip(device_actions, device_actions[1:]):
      assert Gate(prev) in test_schedules._Ancestors(Gate(a), {}), (prev, a)  # pylint: disable=protected-access


def test_list_schedules_run_forwards_first_for_a_nonlinear_loss():
  # The output gradient needs every forward pass: each device's gates follow
  # schedules.ForwardsFirst of the schedule (the linear case is tested above).
  for schedule, num_cells in (('zero_bubble', 2), ('interleaved_1f1b', 4)):
    g = _ListGraph(schedule, num_cells, 2, 4, loss='square')
    spec = schedules.StageSpec(num_cells, 2, 4)
    order = schedules.ForwardsFirst(schedules.Build(schedule, spec))
    assert order != schedules.Build(schedule, spec)
    _AssertGatesFollow(g, order)


def test_the_fallback_is_noted_on_the_console_once(capsys):
  note = loss.NonlinearNote('pipe', 'zero_bubble')
  loss._noted.discard(note)  # pylint: disable=protected-access
  for _ in range(2):  # Two graphs, one line.
    _ListGraph('zero_bubble', 2, 2, 4, loss='square')
  _ListGraph('zero_bubble', 2, 2, 4)  # Linear: no note.
  lines = capsys.readouterr().err.splitlines()
  assert [l for l in lines if 'not linear' in l] == [note]
  assert note.startswith("note: pipe: the loss is not linear in the "
                         "pipeline's outputs; schedule 'zero_bubble' runs "
                         'every forward pass before its backward actions')


def test_list_schedules_refuse_what_they_cannot_run():
  with pytest.raises(ValueError, match='num_micro_batches=3 must be a '
                     'multiple of the number of devices'):
    _ListGraph('interleaved_1f1b', 4, 2, 3)
