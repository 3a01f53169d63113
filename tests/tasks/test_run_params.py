"""The experiment's params, built once per trainer process (run_params.py)."""

import os
import subprocess
import sys

import pytest

from lingvo_ext.runtime import trainer_flags
from lingvo_ext.tasks import experiment_params
from lingvo_ext.tasks import run_params
from tests.support import ROOT
from tests.support import zygote

TINY = 'lm.TransformerLmTinyGPipe'


def _Options(**kwargs):
  return trainer_flags.Options(model=TINY, **kwargs)


@pytest.fixture
def builds(monkeypatch):
  made = []
  real = experiment_params.GetParams

  def Counted(model, dataset, *args, **kwargs):
    made.append(dataset)
    return real(model, dataset, *args, **kwargs)

  monkeypatch.setattr(experiment_params, 'GetParams', Counted)
  return made


def test_each_dataset_is_built_once_and_runners_get_copies(builds):
  params = run_params.RunParams(
      _Options(model_params_override='train.max_steps:7'))
  registry = run_params.ModelRegistry(params)
  a = registry.GetParams(TINY, 'Train')
  b = registry.GetParams(TINY, 'Train')
  assert a is not b and a.train.max_steps == b.train.max_steps == 7
  a.train.max_steps = 9  # A runner changes its copy, not the run's.
  assert params.Train().train.max_steps == 7
  assert params.Dataset('dev') is params.Dataset('Dev')
  registry.GetParams(TINY, 'Dev')
  assert builds == ['Train', 'dev', 'Dev'], builds


def test_the_trainers_built_params_are_the_ones_served(builds):
  cfg = experiment_params.GetParams(TINY, 'Train')
  cfg.train.max_steps = 11  # As a plan set on the built params.
  params = run_params.RunParams(_Options(), train=cfg)
  assert params.Train() is cfg
  assert run_params.ModelRegistry(params).GetParams(
      TINY, 'Train').train.max_steps == 11
  assert builds == ['Train'], builds


def test_a_dataset_the_experiment_lacks_is_one_line(builds):
  del builds
  with pytest.raises(ValueError, match=r"no dataset 'nope' \(nor 'Nope'\)"):
    run_params.RunParams(_Options()).Dataset('nope')


# An experiment noting each build of its params (its Task()) in $BUILDS_FILE.
_EXPERIMENT = '''
import os

from lingvo import model_registry

from params import lm


@model_registry.RegisterSingleTaskModel
class CountedParamsLm(lm.TransformerLmTinyGPipe):

  def Task(self):
    with open(os.environ['BUILDS_FILE'], 'a') as f:
      f.write('%d\\n' % os.getpid())
    return super().Task()
'''


@pytest.mark.e2e
@pytest.mark.parametrize('flags', [[], ['--max_steps=2']])
def test_a_trainer_run_builds_its_params_once(tmp_path, flags):
  (tmp_path / 'exp').mkdir()
  (tmp_path / 'exp' / 'countparams.py').write_text(_EXPERIMENT)
  builds = tmp_path / 'builds'
  env = dict(os.environ, BUILDS_FILE=str(builds),
             PYTHONPATH=os.pathsep.join([str(tmp_path / 'exp'), ROOT]))
  cmd = [sys.executable, '-m', 'lingvo_ext.trainer',
         '--model=countparams.CountedParamsLm', f'--logdir={tmp_path}/log',
         '--model_params_override=train.max_steps:2',
         '--num_cpu_devices=2', '--worker_split_size=2'] + flags
  proc = zygote.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-5000:]
  assert os.path.exists(f'{tmp_path}/log/train/ckpt-00000002.index')
  pids = builds.read_text().split()
  # The controller and the trainer run in this one process.
  assert len(pids) == 1, pids
