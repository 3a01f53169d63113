"""A user's own model, all the way (issue 20), one test (or more) per item.

The e2e tests run the trainer, evaler, decoder and cost_report binaries in
subprocesses, as a user does; one Tiny training run (module fixture) serves
the tests of what follows training.
"""

import concurrent.futures
import fcntl
import json
import os
import re
import shutil
import site
import socket
import subprocess
import sys

import lingvo.compat as tf
from lingvo import model_registry
import pytest

from tests.support import zygote

from lingvo_ext import checkpoints
from lingvo_ext.tasks import experiment_params
from lingvo_ext.core import gpipe
from lingvo_ext.core import schedules
from lingvo_ext.distributed import step_keeping
from lingvo_ext.tasks import pipelined_task
from tests.support import ROOT

TIMEOUT = 300
TINY = 'lm.TransformerLmTinyGPipe'
TRAINED_STEPS = 4
# Every shipped experiment with more than one pipeline cell.
TINY_GPIPE_EXPERIMENTS = ['lm.TransformerLmTinyGPipe',
                          'image.ConvClassifierTinyGPipe']
_ERROR_LINES = ('Traceback', 'Object was never used', 'Logging error',
                'I/O operation on closed file')


def _Run(args, cwd=ROOT, pythonpath=None, timeout=TIMEOUT, module=True,
         fresh=False):
  """(exit code, stdout, stderr) of `python -m args...` (module=False: of
  args), forked (zygote) unless fresh."""
  env = dict(os.environ)
  env['PYTHONPATH'] = pythonpath or ROOT
  cmd = [sys.executable, '-m', *args] if module else list(args)
  run = subprocess.run if fresh else zygote.run
  proc = run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
             timeout=timeout, check=False)
  return proc.returncode, proc.stdout, proc.stderr


def _Train(*flags, **kwargs):
  return _Run(['lingvo_ext.trainer', *flags], **kwargs)


def _TrainAll(flag_lists):
  """_Train of each list of flags, several at once where cores allow."""
  workers = max(1, min(4, (os.cpu_count() or 2) // 4))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(lambda flags: _Train(*flags), flag_lists))


def _Losses(stdout):
  """{step: loss} of the trainer's progress lines."""
  return {int(s): float(l) for s, l in re.findall(
      r'^step (\d+)/\d+  loss (\S+)', stdout, re.M)}


def _NoErrorLines(*texts):
  for text in texts:
    for bad in _ERROR_LINES:
      assert bad not in text, text[-3000:]


def _Flags():
  flags = tf.flags.FLAGS
  if not flags.is_parsed():
    flags.mark_as_parsed()
  return flags


def _Params(model, override=''):
  return experiment_params.GetParams(model, 'Train', override)


@pytest.fixture(scope='module')
def trained(shared_once):
  """A logdir of TINY trained to TRAINED_STEPS (below its MAX_STEPS).

  Built once for all test workers (conftest.py); tests go on in a copy.
  """
  def Build(logdir):
    rc, _, err = _Train(f'--model={TINY}', f'--logdir={logdir}',
                        f'--max_steps={TRAINED_STEPS}')
    assert rc == 0, err[-3000:]
    return logdir

  assert _Params(TINY).train.max_steps > TRAINED_STEPS
  return shared_once('user_path_trained', Build)


def _Copy(logdir, tmp_path):
  copy = str(tmp_path / 'copy')
  shutil.copytree(logdir, copy)
  return copy


# --- 1. The pipeline's switches are task params ---------------------------------


def testEveryPipelineSwitchIsADocumentedTaskParam():
  p = pipelined_task.PipelinedTask.Params()
  layer = gpipe.PipeliningLayer.Params()
  switches = pipelined_task.PipelineSwitches()
  assert {'schedule', 'recompute'} <= {n for n, _, _ in switches}
  for name, default, doc in switches:
    # The layer's default, but where the task's is its own (jit_compile).
    assert p.Get(name) == pipelined_task.TASK_DEFAULTS.get(
        name, layer.Get(name)), name
    assert doc and doc in p._params[name]._description, name  # pylint: disable=protected-access
    assert f"task.{name}:" in p._params[name]._description  # pylint: disable=protected-access


def testALaterEngineParamIsPassedThroughWithoutEdits(monkeypatch):
  # As when the engine adds a param (e.g. jit_compile): it becomes a task
  # param, and the task's value reaches the PipeliningLayer.
  original = gpipe.PipeliningLayer.Params.__func__

  def Params(cls):
    p = original(cls)
    p.Define('future_switch', False, 'A switch the engine adds later.')
    return p

  monkeypatch.setattr(gpipe.PipeliningLayer, 'Params', classmethod(Params))
  tp = pipelined_task.PipelinedTask.Params()
  assert tp.future_switch is False
  assert 'A switch the engine adds later.' in tp._params['future_switch']._description  # pylint: disable=protected-access
  cfg = _Params(TINY, 'task.future_switch:True; task.schedule:"1f1b"')
  assert cfg.task.future_switch is True
  with tf.Graph().as_default():
    cfg.task.input = cfg.input
    task = cfg.task.Instantiate()
    assert task.pipeline.params.future_switch is True
    assert task.pipeline.params.schedule == '1f1b'


def testEngineSwitchesAreTaskParams():
  cfg = _Params(TINY, 'task.cell_functions:False; task.jit_compile:False')
  with tf.Graph().as_default():
    cfg.task.input = cfg.input
    pipeline = cfg.task.Instantiate().pipeline.params
  assert (pipeline.cell_functions, pipeline.jit_compile) == (False, False)


@pytest.mark.parametrize('text,schedule,recompute', [
    ('task.schedule:"1f1b"', '1f1b', None),
    ('task.schedule:recurrent; task.recompute:True', 'recurrent', True),
    ('task.recompute:False', 'unrolled', False),
    ('task.recompute:True; task.recompute:None', 'unrolled', None),
    ("task.schedule:'unrolled'; task.recompute:true", 'unrolled', True),
])
def testScheduleAndRecomputeOverridesReachThePipeline(text, schedule,
                                                      recompute):
  cfg = _Params(TINY, text)
  assert (cfg.task.schedule, cfg.task.recompute) == (schedule, recompute)
  with tf.Graph().as_default():
    cfg.task.input = cfg.input
    pipeline = cfg.task.Instantiate().pipeline.params
  assert (pipeline.schedule, pipeline.recompute) == (schedule, recompute)


def _ScheduleRun(model, schedule, logdir):
  """{step: loss} of 2 steps of `model` under `schedule` through the trainer."""
  rc, out, err = _Train(
      f'--model={model}', f'--logdir={logdir}', '--max_steps=2',
      '--model_params_override=task.schedule:"%s"%s' % (
          schedule.split('+')[0],
          '; task.cell_functions:False' if '+inline' in schedule else ''))
  assert rc == 0, (model, schedule, err[-3000:])
  with open(os.path.join(logdir, 'control', 'params.txt')) as f:
    text = f.read()
  assert f"task.schedule : '{schedule.split('+')[0]}'" in text
  assert ('task.cell_functions : False' in text) == ('+inline' in schedule)
  losses = _Losses(out)
  shutil.rmtree(logdir)
  return losses


# Every schedule from the trainer (cells built once, the default), and cells
# built inline. interleaved_1f1b and zero_bubble run these losses (computed
# after the pipeline) forwards first;
# tests/tasks/test_experiment_schedules.py trains them 200 steps in process,
# and the trainer runs one below.
_SCHEDULES = [s for s in schedules.SCHEDULES
              if s not in schedules.LINEAR_LOSS_ONLY] + ['unrolled+inline']


# Each schedule through the trainer and its override once, on one of the two
# Tiny experiments in turn (tests/tasks/test_experiment_schedules.py trains
# every experiment under every schedule 200 steps in process, and steps the
# full-size ones). One test per schedule, so that test workers share the
# runs; each experiment's 'unrolled' run, the reference, is made once for all
# of them (shared_once).
@pytest.mark.e2e
@pytest.mark.parametrize('model,schedule', [
    (TINY_GPIPE_EXPERIMENTS[i % 2], s) for i, s in enumerate(
        s for s in _SCHEDULES if s != 'unrolled')])
def testEveryScheduleTrainsATinyGPipeExperimentThroughTheTrainer(
    shared_once, tmp_path, model, schedule):
  # The same first loss (same weights and batch) and the same loss after
  # one update (the same gradients) under every schedule.
  reference = {int(k): v for k, v in shared_once(
      'schedule_reference_' + model,
      lambda path: _ScheduleRun(model, 'unrolled', path)).items()}
  assert sorted(reference) == [1, 2], reference
  losses = _ScheduleRun(model, schedule, str(tmp_path / 'run'))
  assert sorted(losses) == [1, 2], (schedule, losses)
  for step in (1, 2):
    assert losses[step] == pytest.approx(reference[step], abs=2e-3), (
        schedule, losses, reference)


@pytest.mark.e2e
def testZeroBubbleTrainsALossNotLinearInTheOutputs(tmp_path):
  # The experiment's loss is computed after the pipeline: zero_bubble runs
  # every forward pass first, then its backward order, and trains.
  logdir = str(tmp_path / 'zb')
  rc, out, err = _Train(f'--model={TINY}', f'--logdir={logdir}',
                        '--max_steps=2', '--num_cpu_devices=2',
                        '--worker_split_size=2',
                        '--model_params_override=task.schedule:"zero_bubble"')
  assert rc == 0, err[-3000:]
  losses = _Losses(out)
  assert sorted(losses) == [1, 2] and all(
      0 < l < 10 for l in losses.values()), losses
  _NoErrorLines(err)
  assert [f for f in os.listdir(os.path.join(logdir, 'train'))
          if f.startswith('ckpt')]


# --- 2. Bad overrides and flags: one line, exit 2, nothing written -----------


def _LeafKeys(p, prefix):
  for name, value in p.IterParams():
    if isinstance(value, (bool, int, float, str)):
      yield prefix + name


def testEveryMisspelledTaskKeyNamesItsCloseMatch():
  cfg = _Params(TINY)
  keys = [k for k in _LeafKeys(cfg.task, 'task.') if len(k.split('.')[-1]) > 5]
  keys += [k for k in _LeafKeys(cfg.task.train, 'task.train.')
           if len(k.split('.')[-1]) > 5]
  assert len(keys) > 20
  for key in keys:
    typo = key[:-1]  # E.g. task.num_micro_batche.
    with pytest.raises(experiment_params.OverrideError) as e:
      experiment_params.ApplyOverrides(cfg.Copy(), f'{typo}:1')
    message = str(e.value)
    assert '\n' not in message
    assert f'unknown key {typo!r}' in message
    assert key in message, message  # The close match, at the right level.


@pytest.mark.parametrize('text,expected', [
    ('task.num_micro_batches:four', 'task.num_micro_batches takes an int'),
    ('task.stack_variables:Flase', 'task.stack_variables takes True or False'),
    ('task.train.learning_rate:fast', 'task.train.learning_rate takes a float'),
    ('task.num_partitions:None', 'takes an int, not None'),
    ('task.train:3', 'task.train holds params'),
    ('task.train.learning_rate.x:3', 'task.train.learning_rate is float'),
    ('garbage', "'garbage' is not key:value"),
    ('tsk.num_partitions:2', 'Did you mean task?'),
])
def testBadOverrideValuesSayTheTypeExpected(text, expected):
  with pytest.raises(experiment_params.OverrideError) as e:
    experiment_params.ApplyOverrides(_Params(TINY), text)
  assert expected in str(e.value) and '\n' not in str(e.value), str(e.value)


@pytest.mark.e2e
def testBadOverridesAndFlagsExit2BeforeTheLogdir(tmp_path):
  logdir = str(tmp_path / 'never')
  cases = [
      (['--model_params_override=task.num_micro_batchs:4'],
       "error: --model_params_override: unknown key 'task.num_micro_batchs': "
       'task has no \'num_micro_batchs\'. Did you mean '
       'task.num_micro_batches'),
      (['--model_params_override=task.num_micro_batches:four'],
       'task.num_micro_batches takes an int'),
      (['--model_params_override=task.schedule:"1f2b"'],
       "task.schedule='1f2b'; use one of %s" % sorted(schedules.SCHEDULES)),
      (['--max_step=3'], "error: Unknown command line flag 'max_step'. Did "
       'you mean: max_steps'),
      # One replica of a 2-cell pipeline is "x 1 replicas".
      (['--num_cpu_devices=2', '--worker_split_size=2',
        '--model_params_override=task.num_micro_batches:3'],
       '(input.batch_size=8 per replica x 1 replicas) is not divisible by '
       'replicas x micro-batches = 1 x 3'),
  ]
  results = _TrainAll([[f'--model={TINY}', f'--logdir={logdir}', *flags]
                       for flags, _ in cases])
  for (flags, expected), (rc, out, err) in zip(cases, results):
    assert rc == 2, (flags, err[-3000:])
    lines = [l for l in err.splitlines() if l.startswith('error:')]
    assert len(lines) == 1 and expected in lines[0], (flags, err[-3000:])
    assert 'Traceback' not in err + out
    assert not os.path.exists(logdir), flags


# --- 3. One trainer per logdir -------------------------------------------------


def testTheTrainerLockIsHeldAndNamesItsHolder(tmp_path):
  from lingvo_ext import trainer  # pylint: disable=g-import-not-at-top
  assert trainer._LockLogdir(str(tmp_path)) is None  # pylint: disable=protected-access
  try:
    path = str(tmp_path / trainer.LOCK_FILE)
    with open(path) as f:
      assert f.read() == f'PID {os.getpid()} on host {socket.gethostname()}\n'
    # Another process cannot take it.
    code = ('import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n'
            'try:\n  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n'
            'except OSError:\n  sys.exit(7)\n')
    rc, _, _ = _Run([sys.executable, '-c', code, path], module=False)
    assert rc == 7
  finally:
    os.close(trainer._LOCK.pop('fd'))  # pylint: disable=protected-access


@pytest.mark.e2e
def testASecondTrainerOnALogdirIsRefused(trained, tmp_path):
  logdir = _Copy(trained, tmp_path)
  # The lock as a running trainer holds it.
  fd = os.open(os.path.join(logdir, 'trainer.lock'), os.O_RDWR | os.O_CREAT)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  os.ftruncate(fd, 0)
  os.write(fd, b'PID 4242 on host elsewhere\n')
  try:
    rc, out, err = _Train(f'--model={TINY}', f'--logdir={logdir}',
                          f'--max_steps={TRAINED_STEPS + 2}')
  finally:
    os.close(fd)
  assert rc == 2, err[-3000:]
  assert (f'error: --logdir={logdir} is in use by the trainer PID 4242 on '
          'host elsewhere') in err, err[-3000:]
  assert not _Losses(out)
  # Released (the holder ended): training goes on.
  rc, out, err = _Train(f'--model={TINY}', f'--logdir={logdir}',
                        f'--max_steps={TRAINED_STEPS + 2}')
  assert rc == 0, err[-3000:]
  assert min(_Losses(out)) == TRAINED_STEPS + 1


# --- 4. The evaler and decoder finish, and print their metrics -------------------


@pytest.mark.e2e
@pytest.mark.parametrize('job,metric', [('evaler_dev', 'log_pplx'),
                                        ('decoder_dev', 'num_samples_in_batch')])
def testEvalJobsFinishAfterTheLastCheckpointAndPrintMetrics(
    trained, tmp_path, job, metric):
  logdir = _Copy(trained, tmp_path)
  # No --max_steps: the experiment's MAX_STEPS is higher than the trainer's.
  rc, out, err = _Train(f'--model={TINY}', f'--logdir={logdir}',
                        f'--job={job}', timeout=240)
  assert rc == 0, err[-3000:]
  m = re.search(rf'^{job}: step {TRAINED_STEPS}  .*{metric} (\S+)', out, re.M)
  assert m, out[-3000:]
  assert float(m.group(1)) > 0
  _NoErrorLines(out, err)
  # Again: the last checkpoint was processed; it says so and exits.
  rc, out, err = _Train(f'--model={TINY}', f'--logdir={logdir}',
                        f'--job={job}', timeout=240)
  assert rc == 0, err[-3000:]
  assert f'{job}: training finished at ckpt-{TRAINED_STEPS:08d}' in out, out
  _NoErrorLines(out, err)


# --- 5. A finished logdir says so -------------------------------------------------


@pytest.mark.e2e
def testAFinishedLogdirSaysSo(trained, tmp_path):
  logdir = _Copy(trained, tmp_path)
  rc, out, err = _Train(f'--model={TINY}', f'--logdir={logdir}',
                        f'--max_steps={TRAINED_STEPS}')
  assert rc == 0, err[-3000:]
  assert out.strip() == (
      f'already trained to step {TRAINED_STEPS} (max_steps {TRAINED_STEPS}): '
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
  logdir = _Copy(trained, tmp_path)
  with open(os.path.join(logdir, 'train', 'checkpoint'), 'w') as f:
    f.write('garbage !!! {{')
  rc, out, err = _Train(f'--model={TINY}', f'--logdir={logdir}',
                        f'--max_steps={TRAINED_STEPS + 2}')
  assert rc == 0, err[-3000:]
  assert re.search(r'warning: .*checkpoint does not parse .*; rebuilt it from '
                   r'the checkpoints on disk \(latest: .*ckpt-%08d\)' %
                   TRAINED_STEPS, err), err[-3000:]
  assert min(_Losses(out)) == TRAINED_STEPS + 1  # Resumed, not restarted.
  latest = tf.train.latest_checkpoint(os.path.join(logdir, 'train'))
  assert latest.endswith(f'ckpt-{TRAINED_STEPS + 2:08d}')


# --- 7. An installable package -----------------------------------------------------


@pytest.mark.e2e
def testPipInstallGivesThePackagesAndEntryPoints(tmp_path):
  # A copy of the sources, so that the build leaves nothing in the repo.
  src = tmp_path / 'src'
  src.mkdir()
  for name in ('pyproject.toml', 'README.md'):
    shutil.copy(os.path.join(ROOT, name), str(src / name))
  shutil.copytree(os.path.join(ROOT, 'lingvo_ext'), str(src / 'lingvo_ext'),
                  ignore=shutil.ignore_patterns('__pycache__'))
  for editable in ([], ['-e']):
    venv = tmp_path / f'venv{len(editable)}'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)],
                   check=True, timeout=TIMEOUT)
    py = str(venv / 'bin' / 'python')
    # The heavy dependencies (and pip, setuptools) from this interpreter's
    # environment.
    purelib = subprocess.run(
        [py, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
        capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, 'deps.pth'), 'w') as f:
      f.write('\n'.join(site.getsitepackages()) + '\n')
    rc, out, err = _Run([py, '-m', 'pip', 'install', '-q', '--no-deps',
                         '--no-build-isolation', *editable, str(src)],
                        cwd=str(tmp_path), module=False)
    assert rc == 0, err[-3000:]
    # Importable from anywhere, from the install. In the editable one the
    # experiments are found, not imported again (importing them imports
    # TensorFlow, seconds of CPU): the same finder resolves both. No
    # top-level `params` package is installed (the name is not ours).
    exps = ('importlib.util.find_spec("lingvo_ext.experiments").origin'
            if editable else
            'importlib.import_module("lingvo_ext.experiments").__file__')
    rc, out, err = _Run([py, '-c', 'import importlib.util, lingvo_ext; '
                         f'print(lingvo_ext.__file__, {exps}, '
                         'importlib.util.find_spec("params"))'],
                        cwd='/', module=False, pythonpath=os.devnull)
    assert rc == 0, err[-3000:]
    where = str(src) if editable else purelib
    assert out.split() == [
        os.path.join(where, 'lingvo_ext', '__init__.py'),
        os.path.join(where, 'lingvo_ext', 'experiments', '__init__.py'),
        'None'], out
    if editable:
      continue  # The same entry points; the first install ran them.
    for script, expected in (('lingvo-ext-train', '--max_steps'),
                             ('lingvo-ext-launch', '--workers'),
                             ('lingvo-ext-cost-report', '--num_partitions')):
      rc, out, err = _Run([str(venv / 'bin' / script), '--help'], cwd='/',
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
  flags = _Flags()
  names = ('num_cpu_devices', 'worker_split_size', 'run_locally', 'mode')
  saved = {n: flags[n].value for n in names}
  try:
    for devices, split in ((2, 2), (4, 2), (4, 4), (2, 1)):
      for n, v in zip(names, (devices, split, 'cpu', 'sync')):
        setattr(flags, n, v)
      manager = runners.RunnerManager(TINY)
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
  flags = _Flags()
  assert cost_report.main([f'--model={TINY}', '--json']) == 0
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
    manager = runners.RunnerManager(TINY)
    params = cluster_factory.Cluster.Params()
    manager.UpdateClusterParamsFromFlags(params, 'trainer_client')
    params.mode, params.job = 'sync', 'trainer_client'
    with tf.Graph().as_default(), cluster_factory.Cluster(params) as c:
      with tf.device(c.GetPlacer()):
        model = _Params(TINY).Instantiate()
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
          'import lingvo_ext.experiments; tf.flags.FLAGS.mark_as_parsed(); '
          f'print(model_registry.GetParams("{TINY}", "Train").task.name); '
          'from lingvo_ext.tools import convert_checkpoint; '
          f'print(convert_checkpoint.ModelParams("{TINY}").task.name)')
  rc, out, err = _Run([sys.executable, '-c', code], cwd=str(tmp_path),
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
    rc, out, err = _Train(*common, *flags, cwd=str(exp), pythonpath=path,
                          **kwargs)
    assert rc == 0, err[-3000:]
    outputs.extend([out, err])
    return out

  out = Step('--max_steps=4', '--job=controller,trainer_client,evaler_dev')
  losses = _Losses(out)
  assert sorted(losses)[-1] == 4
  m = re.search(r'^evaler_dev: step 4  accuracy (\S+)  loss (\S+)', out, re.M)
  assert m, out
  assert 0 <= float(m.group(1)) <= 1
  # Resumed under another schedule, by override alone.
  out = Step('--max_steps=6', '--model_params_override=task.schedule:"1f1b"')
  assert min(_Losses(out)) == 5
  with open(os.path.join(logdir, 'control', 'params.txt')) as f:
    assert "task.schedule : '1f1b'" in f.read()
  out = Step('--job=evaler_dev', timeout=240)
  assert re.search(r'^evaler_dev: step 6  accuracy', out, re.M), out
  _NoErrorLines(*outputs)
  # The layer's names are those of the stack (cost_report reads them too).
  rc, out, err = _Run(['lingvo_ext.tools.cost_report',
                       '--model=own_model.ResidualMlpDigits'], cwd=str(exp),
                      pythonpath=path)
  assert rc == 0, err[-3000:]
  for name in ('proj', 'block0', 'block3', 'head'):
    assert re.search(rf'^\s*\d+\s+{name}\s', out, re.M), out
