"""SeqLayer (lingvo_ext/core/seq_layer.py): cells round-robin over the split's
devices, and each cell's variables live on the device that runs it."""

import re

import lingvo.compat as tf

from lingvo_ext.core import gpipe
from lingvo_ext.core import seq_layer
from tests.core import test_gpipe
from tests.support import gpipe_testlib as lib

D = test_gpipe.D


def test_seq_layer_round_robins_extra_cells():
  # SeqLayer's documented behaviour: cells wrap round the split's devices.
  with tf.Graph().as_default(), lib.Cluster(2):
    net = seq_layer.SeqLayer.Params().Set(
        name='seq', cell_tpl=test_gpipe._FcCells(3, 1)).Instantiate()  # pylint: disable=protected-access
    out = net.FPropDefaultTheta(tf.zeros([2, D]))
    assert out.shape.as_list() == [2, D]


def _VariableDevices(job, colocate, ps_devices=2):
  """{variable name: device} of a 2-cell pipeline under Lingvo's placer."""
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  cp = cluster_factory.ForTestingWorker(
      mode='sync', job=job, cpus=2, split_size=2).params
  cp.ps.cpus_per_replica = ps_devices  # The trainer's --num_cpu_devices.
  c = cp.Instantiate()
  g = tf.Graph()
  with g.as_default(), c, tf.device(c.GetPlacer()):
    gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=test_gpipe._FcCells(2, layers_per_cell=3),  # pylint: disable=protected-access
        num_micro_batches=2, colocate_cell_variables=colocate).Instantiate()
    return {
        v.op.name: v.device.split('device:')[-1] for v in tf.global_variables()
    }


def test_cell_variables_live_on_their_cells_device():
  # The controller's graph and the trainer's must agree: they share the
  # variables by device and name.
  for job in ('trainer_client', 'controller'):
    devices = _VariableDevices(job, True)
    assert len(devices) == 12
    for name, device in devices.items():
      cell = int(re.search(r'cell(\d)/', name).group(1))
      assert device == 'CPU:%d' % cell, (job, name, device)
  # Lingvo's least-loaded placer alone spreads each cell over both devices.
  spread = _VariableDevices('trainer_client', False)
  assert {d for n, d in spread.items() if 'cell0/' in n} == {'CPU:0', 'CPU:1'}
  # Variables on a ps device that is not a worker device stay there.
  assert set(_VariableDevices('trainer_client', True, 1).values()) == {'CPU:0'}
