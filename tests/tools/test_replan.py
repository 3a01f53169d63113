"""lingvo_ext.tools.replan: the planner for the devices a cluster has left,
the experiment's global batch kept, the memory check (tools/replan.py)."""

import json

import pytest

from lingvo_ext.planner import memory_model
from lingvo_ext.planner import memory_probe
from lingvo_ext.tools import replan

MODEL = 'lm.TransformerLmTinyGPipe'  # 2 cells, input.batch_size 8.
_CONSTANTS = memory_model.Constants(runtime_bytes=700 * 2**20,
                                    activation_factor=1.5,
                                    bytes_per_op=10 * 1024.)


def _Args(*flags):
  return replan._Parser().parse_args([f'--model={MODEL}', *flags])  # pylint: disable=protected-access


@pytest.fixture
def constants(monkeypatch):
  """The memory model's constants without the machine's probe runs."""
  monkeypatch.setattr(memory_probe, 'Get', lambda n, force=False: _CONSTANTS)


def testOntoOneDeviceTheGlobalBatchIsKept(constants):
  del constants
  got = replan.Replan(_Args('--devices=1', '--replicas=1'),
                      available=64 * 2**30)
  assert (got['workers'], got['worker_split_size'], got['devices']) == (1, 1, 1)
  assert got['global_batch'] == 8 and got['replicas'] == 1
  assert "input.batch_size:8" in got['model_params_override']
  assert f"task.num_partitions:{got['cells']}" in got['model_params_override']
  assert got['checkpoint'] is None


def testTwoReplicasGlobalBatchIsKeptOnTheDevicesLeft(constants):
  del constants
  # 2 replicas of 8 before the loss: 16 examples a step on the 3 left.
  got = replan.Replan(_Args('--devices=3', '--replicas=2'),
                      available=64 * 2**30)
  assert got['global_batch'] == 16
  assert got['devices'] <= 3 and got['workers'] == got['devices']
  batch = 16 // got['replicas']
  assert f'input.batch_size:{batch}' in got['model_params_override']


def testTheUsersOverrideComesFirst(constants):
  del constants
  got = replan.Replan(_Args('--devices=1',
                            '--model_params_override=train.max_steps:7'),
                      available=64 * 2**30)
  assert got['model_params_override'].startswith('train.max_steps:7; ')


def testWholeWorkersOnly(constants):
  del constants
  got = replan.Replan(_Args('--devices=4', '--devices_per_worker=2'),
                      available=64 * 2**30)
  assert got['devices'] % 2 == 0 and got['num_cpu_devices'] == 2
  assert got['workers'] == got['devices'] // 2


def testNoPlanFitsTheMemory(constants):
  del constants
  with pytest.raises(ValueError, match='no plan fits'):
    replan.Replan(_Args('--devices=1'), available=2**20, source='x')


def testMainPrintsOneJsonObjectAndOneErrorLine(constants, capsys,
                                               monkeypatch):
  del constants
  assert replan.main([f'--model={MODEL}', '--devices=1', '--json']) == 0
  got = json.loads(capsys.readouterr().out)
  assert got['workers'] == 1 and got['model'] == MODEL
  assert replan.main([f'--model={MODEL}', '--devices=0']) == 2
  err = capsys.readouterr().err.strip()
  assert err == '--devices=0 must be >= 1, e.g. --devices=1.'.join(
      ['error: ', '']), err
  from lingvo_ext.distributed import task_health  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(task_health, 'AvailableBytes',
                      lambda: (2**20, "the cgroup's memory limit"))
  assert replan.main([f'--model={MODEL}', '--devices=1']) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      'error: no plan fits 1 device(s): '), err
