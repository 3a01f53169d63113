"""A user's own model, all the way (issue 20), one test (or more) per item.

The e2e tests run the trainer, evaler, decoder and cost_report binaries in
subprocesses, as a user does; one Tiny training run (module fixture) serves
the tests of what follows training. Items 1 and 2 (task params, bad
overrides) are tests/e2e/test_user_overrides.py's.
"""

import fcntl
import json
import os
import re
import shutil
import site
import socket
import subprocess
import sys

from lingvo import model_registry
import lingvo.compat as tf
import pytest

from lingvo_ext import checkpoints
from lingvo_ext.distributed import step_keeping
from tests.support import ROOT
from tests.support import user_path_testlib as lib


@pytest.fixture(scope='module')
def trained(shared_once):
  """A logdir of TINY trained to TRAINED_STEPS (below its MAX_STEPS; lib).

  Built once for all test workers (conftest.py); tests go on in a copy.
  """
  def Build(logdir):
    rc, _, err = lib.Train(f'--model={lib.TINY}', f'--logdir={logdir}',
                           f'--max_steps={lib.TRAINED_STEPS}')
    assert rc == 0, err[-3000:]
    return logdir

  assert lib.Params(lib.TINY).train.max_steps > lib.TRAINED_STEPS
  return shared_once('user_path_trained', Build)



# --- 3. One trainer per logdir -------------------------------------------------


def testTheTrainerLockIsHeldAndNamesItsHolder(tmp_path):
  from lingvo_ext import trainer  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import logdir  # pylint: disable=g-import-not-at-top
  assert logdir.Lock(str(tmp_path)) is None
  try:
    path = str(tmp_path / trainer.LOCK_FILE)
    with open(path) as f:
      assert f.read() == f'PID {os.getpid()} on host {socket.gethostname()}\n'
    # Another process cannot take it.
    code = ('import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n'
            'try:\n  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n'
            'except OSError:\n  sys.exit(7)\n')
    rc, _, _ = lib.Run([sys.executable, '-c', code, path], module=False)
    assert rc == 7
  finally:
    os.close(logdir._LOCK.pop('fd'))  # pylint: disable=protected-access


@pytest.mark.e2e
def testASecondTrainerOnALogdirIsRefused(trained, tmp_path):
  logdir = lib.Copy(trained, tmp_path)
  # The lock as a running trainer holds it.
  fd = os.open(os.path.join(logdir, 'trainer.lock'), os.O_RDWR | os.O_CREAT)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  os.ftruncate(fd, 0)
  os.write(fd, b'PID 4242 on host elsewhere\n')
  try:
    rc, out, err = lib.Train(f'--model={lib.TINY}', f'--logdir={logdir}',
                             f'--max_steps={lib.TRAINED_STEPS + 2}')
  finally:
    os.close(fd)
  assert rc == 2, err[-3000:]
  assert (f'error: --logdir={logdir} is in use by the trainer PID 4242 on '
          'host elsewhere') in err, err[-3000:]
  assert not lib.Losses(out)
  # Released (the holder ended): training goes on.
  rc, out, err = lib.Train(f'--model={lib.TINY}', f'--logdir={logdir}',
                           f'--max_steps={lib.TRAINED_STEPS + 2}')
  assert rc == 0, err[-3000:]
  assert min(lib.Losses(out)) == lib.TRAINED_STEPS + 1


# --- 4. The evaler and decoder finish, and print their metrics -------------------


@pytest.mark.e2e
@pytest.mark.parametrize('job,metric', [('evaler_dev', 'log_pplx'),
                                        ('decoder_dev', 'num_samples_in_batch')])
def testEvalJobsFinishAfterTheLastCheckpointAndPrintMetrics(
    trained, tmp_path, job, metric):
  logdir = lib.Copy(trained, tmp_path)
  # No --max_steps: the experiment's MAX_STEPS is higher than the trainer's.
  rc, out, err = lib.Train(f'--model={lib.TINY}', f'--logdir={logdir}',
                           f'--job={job}', timeout=240)
  assert rc == 0, err[-3000:]
  m = re.search(rf'^{job}: step {lib.TRAINED_STEPS}  .*{metric} (\S+)', out,
                re.M)
  assert m, out[-3000:]
  assert float(m.group(1)) > 0
  lib.NoErrorLines(out, err)
  # Again: the last checkpoint was processed; it says so and exits.
  rc, out, err = lib.Train(f'--model={lib.TINY}', f'--logdir={logdir}',
                           f'--job={job}', timeout=240)
  assert rc == 0, err[-3000:]
  assert f'{job}: training finished at ckpt-{lib.TRAINED_STEPS:08d}' in out, out
  lib.NoErrorLines(out, err)


# --- 5. A finished logdir says so -------------------------------------------------


@pytest.mark.e2e
def testAFinishedLogdirSaysSo(trained, tmp_path):
  logdir = lib.Copy(trained, tmp_path)
  rc, out, err = lib.Train(f'--model={lib.TINY}', f'--logdir={logdir}',
                           f'--max_steps={lib.TRAINED_STEPS}')
  assert rc == 0, err[-3000:]
  assert out.strip() == (
      f'already trained to step {lib.TRAINED_STEPS} '
      f'(max_steps {lib.TRAINED_STEPS}): '
      'nothing to do; raise --max_steps to go on.'), out


# --- 6. A damaged checkpoint state file is rebuilt -----------------------------------


@pytest.mark.parametrize('garbage', [b'garbage !!! {{', b'\xff\xfe\x00\x81',
                                     b'', b'model_checkpoint_path: "gone"'])
def testAGarbageStateFileIsRebuiltFromTheCheckpointsOnDisk(tmp_path, garbage):
  train_dir = str(tmp_path)
  for step in (0, 20, 100, 7):
    for suffix in ('.index', '.data-00000-of-00001'):
      (tmp_path / f'ckpt-{step:08d}{suffix}').write_bytes(b'x')
  (tmp_path / 'checkpoint').write_bytes(garbage)
  assert checkpoints.RebuildStateFile(train_dir)
  state = tf.train.get_checkpoint_state(train_dir)
  assert state.model_checkpoint_path == str(tmp_path / 'ckpt-00000100')
  assert list(state.all_model_checkpoint_paths) == [
      str(tmp_path / f'ckpt-{s:08d}') for s in (0, 7, 20, 100)]
  assert checkpoints.RebuildStateFile(train_dir) is None  # Now intact.


@pytest.mark.e2e
def testTrainingResumesFromTheNewestIntactCheckpointAfterAGarbageStateFile(
    trained, tmp_path):
  logdir = lib.Copy(trained, tmp_path)
  with open(os.path.join(logdir, 'train', 'checkpoint'), 'w') as f:
    f.write('garbage !!! {{')
  rc, out, err = lib.Train(f'--model={lib.TINY}', f'--logdir={logdir}',
                           f'--max_steps={lib.TRAINED_STEPS + 2}')
  assert rc == 0, err[-3000:]
  assert re.search(r'warning: .*checkpoint does not parse .*; rebuilt it from '
                   r'the checkpoints on disk \(latest: .*ckpt-%08d\)' %
                   lib.TRAINED_STEPS, err), err[-3000:]
  # Resumed, not restarted.
  assert min(lib.Losses(out)) == lib.TRAINED_STEPS + 1
  latest = tf.train.latest_checkpoint(os.path.join(logdir, 'train'))
  assert latest.endswith(f'ckpt-{lib.TRAINED_STEPS + 2:08d}')


# --- 7. An installable package -----------------------------------------------------


@pytest.mark.e2e
def testPipInstallGivesThePackagesAndEntryPoints(tmp_path):
  # A copy of the sources, so that the build leaves nothing in the repo.
  src = tmp_path / 'src'
  src.mkdir()
  for name in ('pyproject.toml', 'README.md'):
    shutil.copy(os.path.join(ROOT, name), str(src / name))
  for package in ('lingvo_ext', 'params'):
    shutil.copytree(os.path.join(ROOT, package), str(src / package),
                    ignore=shutil.ignore_patterns('__pycache__'))
  for editable in ([], ['-e']):
    venv = tmp_path / f'venv{len(editable)}'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)],
                   check=True, timeout=lib.TIMEOUT)
    py = str(venv / 'bin' / 'python')
    # The heavy dependencies (and pip, setuptools) from this interpreter's
    # environment.
    purelib = subprocess.run(
        [py, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
        capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, 'deps.pth'), 'w') as f:
      f.write('\n'.join(site.getsitepackages()) + '\n')
    rc, out, err = lib.Run([py, '-m', 'pip', 'install', '-q', '--no-deps',
                            '--no-build-isolation', *editable, str(src)],
                        cwd=str(tmp_path), module=False)
    assert rc == 0, err[-3000:]
    # Importable from anywhere, from the install: lingvo_ext and the
    # top-level `params` package of the experiments (found, not imported:
    # importing them imports TensorFlow, seconds of CPU).
    rc, out, err = lib.Run([py, '-c', 'import importlib.util; '
                            'import lingvo_ext; print(lingvo_ext.__file__, '
                            'importlib.util.find_spec("params").origin)'],
                        cwd='/', module=False, pythonpath=os.devnull)
    assert rc == 0, err[-3000:]
    where = str(src) if editable else purelib
    assert out.split() == [
        os.path.join(where, 'lingvo_ext', '__init__.py'),
        os.path.join(where, 'params', '__init__.py')], out
    if editable:
      continue  # The same entry points; the first install ran them.
    for script, expected in (('lingvo-ext-train', '--max_steps'),
                             ('lingvo-ext-launch', '--workers'),
                             ('lingvo-ext-cost-report', '--num_partitions')):
      rc, out, err = lib.Run([str(venv / 'bin' / script), '--help'], cwd='/',
                             module=False, pythonpath=os.devnull)
      assert rc == 0 and expected in out, (script, err[-3000:])


# --- 9. The smaller messages -----------------------------------------------------


def _Ranges(text):
  return [(int(a), int(b)) for a, b in re.findall(r'(\d+)\.\.(\d+)', text)]


@pytest.mark.parametrize('saved,controller_step,trainer_last', [
    (849, 849, 991), (849, 900, 991), (0, 0, 12), (100, 150, 150)])
def testLostWorkerLinesAgree(saved, controller_step, trainer_last):
  controller = step_keeping.RestoredLine(3, 'pipeline/x/w', 'ckpt-x', saved,
                                        controller_step)
  assert f'the updates of the steps after {saved} are lost' in controller
  assert f'goes on from {controller_step}' in controller
  for a, b in _Ranges(controller):
    assert a <= b, controller
  if trainer_last > controller_step:
    trainer = step_keeping.TrainerStepLine(controller_step, trainer_last)
    assert f'set it back to {trainer_last}' in trainer
    assert _Ranges(trainer) == [(controller_step + 1, trainer_last)]


def testTheControllerSeesTheTrainersReplicas():
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top

  from lingvo_ext.runtime import runners  # pylint: disable=g-import-not-at-top
  flags = lib.Flags()
  names = ('num_cpu_devices', 'worker_split_size', 'run_locally', 'mode')
  saved = {n: flags[n].value for n in names}
  try:
    for devices, split in ((2, 2), (4, 2), (4, 4), (2, 1)):
      for n, v in zip(names, (devices, split, 'cpu', 'sync')):
        setattr(flags, n, v)
      manager = runners.RunnerManager(lib.TINY)
      splits = {}
      for job in ('controller', 'trainer_client'):
        params = cluster_factory.Cluster.Params()
        manager.UpdateClusterParamsFromFlags(params, job)
        cluster = cluster_factory.Cluster(params)
        splits[job] = (cluster.num_splits_per_client,
                       cluster.num_devices_per_split)
      assert splits['controller'] == splits['trainer_client'] == (
          devices // split, split), splits
  finally:
    for n, v in saved.items():
      setattr(flags, n, v)


def testCostReportPlacesVariablesWhereTheTrainerDoes(capsys):
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top

  from lingvo_ext.runtime import runners  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tools import cost_report  # pylint: disable=g-import-not-at-top
  flags = lib.Flags()
  assert cost_report.main([f'--model={lib.TINY}', '--json']) == 0
  report = json.loads(capsys.readouterr().out)
  reported = {f'{l["name"]}/{sh["var"]}': sh['device'] for l in report['layers']
              for sh in l['param_shards']}
  index = {l['name']: l['index'] for l in report['layers']}
  assert 'softmax/logits.w' in reported
  # The trainer's own placement, --num_cpu_devices=2 --worker_split_size=2
  # (with the flags Lingvo's MaybeConfigRunLocally sets for a local run).
  local = dict(num_cpu_devices=2, worker_split_size=2, run_locally='cpu',
               mode='sync',
               controller_job='/job:localhost', worker_job='/job:localhost',
               ps_job='/job:localhost', worker_replicas=1, ps_replicas=1,
               worker_gpus=0, ps_gpus=0, task=0)
  saved = {n: flags[n].value for n in local}
  try:
    for n, v in local.items():
      setattr(flags, n, v)
    manager = runners.RunnerManager(lib.TINY)
    params = cluster_factory.Cluster.Params()
    manager.UpdateClusterParamsFromFlags(params, 'trainer_client')
    params.mode, params.job = 'sync', 'trainer_client'
    with tf.Graph().as_default(), cluster_factory.Cluster(params) as c:
      with tf.device(c.GetPlacer()):
        model = lib.Params(lib.TINY).Instantiate()
      variables = {v.op.name: v.device for v in tf.global_variables()}
  finally:
    for n, v in saved.items():
      setattr(flags, n, v)
  del model
  checked = 0
  for key, device in reported.items():
    layer, var = key.split('/')
    var = var.replace('.', '/')
    # The layer's own name, or Lingvo's cell_<index> leaf name.
    suffixes = (f'/{layer}/{var}/var', f'/cell_{index[layer]:03d}/{var}/var')
    found = [d for n, d in variables.items() if n.endswith(suffixes)]
    assert len(found) == 1, (key, sorted(variables))
    assert found[0].endswith(device.split('/job:localhost')[-1]) and (
        device.split('device:')[-1] == found[0].split('device:')[-1]), (
            key, device, found[0])
    checked += 1
  assert checked >= 3
  assert reported['softmax/logits.w'].endswith('CPU:1')


@pytest.mark.e2e  # A fresh interpreter.
def testLookingUpAnExperimentPrintsNoLingvoImportLines(tmp_path):
  code = ('import lingvo.compat as tf; from lingvo import model_registry; '
          'import params; tf.flags.FLAGS.mark_as_parsed(); '
          f'print(model_registry.GetParams("{lib.TINY}", "Train").task.name); '
          'from lingvo_ext.tools import convert_checkpoint; '
          f'print(convert_checkpoint.ModelParams("{lib.TINY}").task.name)')
  rc, out, err = lib.Run([sys.executable, '-c', code], cwd=str(tmp_path),
                         module=False, fresh=True)
  assert rc == 0, err[-3000:]
  assert out.split() == ['lm', 'lm']
  assert 'model_imports.py: Importing' not in err, err[-3000:]


# --- 10. Your own model, outside the repository -------------------------------------


@pytest.mark.e2e
def testOwnModelTrainsEvaluatesSwitchesScheduleAndResumes(tmp_path):
  exp = tmp_path / 'exp'
  exp.mkdir()
  shutil.copy(os.path.join(ROOT, 'lingvo_ext', 'examples', 'own_model.py'),
              str(exp / 'own_model.py'))
  logdir = str(tmp_path / 'log')
  path = f'{exp}{os.pathsep}{ROOT}'
  common = ['--model=own_model.ResidualMlpDigits', f'--logdir={logdir}',
            '--num_cpu_devices=2', '--worker_split_size=2']
  outputs = []

  def Step(*flags, **kwargs):
    rc, out, err = lib.Train(*common, *flags, cwd=str(exp), pythonpath=path,
                             **kwargs)
    assert rc == 0, err[-3000:]
    outputs.extend([out, err])
    return out

  out = Step('--max_steps=4', '--job=controller,trainer_client,evaler_dev')
  losses = lib.Losses(out)
  assert sorted(losses)[-1] == 4
  m = re.search(r'^evaler_dev: step 4  accuracy (\S+)  loss (\S+)', out, re.M)
  assert m, out
  assert 0 <= float(m.group(1)) <= 1
  # Resumed under another schedule, by override alone.
  out = Step('--max_steps=6', '--model_params_override=task.schedule:"1f1b"')
  assert min(lib.Losses(out)) == 5
  with open(os.path.join(logdir, 'control', 'params.txt')) as f:
    assert "task.schedule : '1f1b'" in f.read()
  out = Step('--job=evaler_dev', timeout=240)
  assert re.search(r'^evaler_dev: step 6  accuracy', out, re.M), out
  lib.NoErrorLines(*outputs)
  # The layer's names are those of the stack (cost_report reads them too).
  rc, out, err = lib.Run(['lingvo_ext.tools.cost_report',
                          '--model=own_model.ResidualMlpDigits'], cwd=str(exp),
                      pythonpath=path)
  assert rc == 0, err[-3000:]
  for name in ('proj', 'block0', 'block3', 'head'):
    assert re.search(rf'^\s*\d+\s+{name}\s', out, re.M), out
