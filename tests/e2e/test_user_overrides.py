"""A user's own model (issue 20): the pipeline's switches are task params,
and bad overrides and flags get one line, exit 2, nothing written.

tests/e2e/test_user_path.py has the rest of the user's path (one trainer per
logdir, the evaler and decoder, damaged state, the package, their own model).
"""

import os
import shutil

import lingvo.compat as tf
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import schedules
from lingvo_ext.tasks import experiment_params
from lingvo_ext.tasks import pipelined_task
from tests.support import user_path_testlib as lib

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
  cfg = lib.Params(lib.TINY, 'task.future_switch:True; task.schedule:"1f1b"')
  assert cfg.task.future_switch is True
  with tf.Graph().as_default():
    cfg.task.input = cfg.input
    task = cfg.task.Instantiate()
    assert task.pipeline.params.future_switch is True
    assert task.pipeline.params.schedule == '1f1b'


def testEngineSwitchesAreTaskParams():
  cfg = lib.Params(lib.TINY,
                   'task.cell_functions:False; task.jit_compile:False')
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
  cfg = lib.Params(lib.TINY, text)
  assert (cfg.task.schedule, cfg.task.recompute) == (schedule, recompute)
  with tf.Graph().as_default():
    cfg.task.input = cfg.input
    pipeline = cfg.task.Instantiate().pipeline.params
  assert (pipeline.schedule, pipeline.recompute) == (schedule, recompute)


def _ScheduleRun(model, schedule, logdir):
  """{step: loss} of 2 steps of `model` under `schedule` through the trainer."""
  rc, out, err = lib.Train(
      f'--model={model}', f'--logdir={logdir}', '--max_steps=2',
      '--model_params_override=task.schedule:"%s"%s' % (
          schedule.split('+')[0],
          '; task.cell_functions:False' if '+inline' in schedule else ''))
  assert rc == 0, (model, schedule, err[-3000:])
  with open(os.path.join(logdir, 'control', 'params.txt')) as f:
    text = f.read()
  assert f"task.schedule : '{schedule.split('+')[0]}'" in text
  assert ('task.cell_functions : False' in text) == ('+inline' in schedule)
  losses = lib.Losses(out)
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
    (lib.TINY_GPIPE_EXPERIMENTS[i % 2], s) for i, s in enumerate(
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
  rc, out, err = lib.Train(f'--model={lib.TINY}', f'--logdir={logdir}',
                           '--max_steps=2', '--num_cpu_devices=2',
                           '--worker_split_size=2',
                           '--model_params_override=task.schedule:"zero_bubble"')
  assert rc == 0, err[-3000:]
  losses = lib.Losses(out)
  assert sorted(losses) == [1, 2] and all(
      0 < l < 10 for l in losses.values()), losses
  lib.NoErrorLines(err)
  assert [f for f in os.listdir(os.path.join(logdir, 'train'))
          if f.startswith('ckpt')]


# --- 2. Bad overrides and flags: one line, exit 2, nothing written -----------


def _LeafKeys(p, prefix):
  for name, value in p.IterParams():
    if isinstance(value, (bool, int, float, str)):
      yield prefix + name


def testEveryMisspelledTaskKeyNamesItsCloseMatch():
  cfg = lib.Params(lib.TINY)
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
    experiment_params.ApplyOverrides(lib.Params(lib.TINY), text)
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
  results = lib.TrainAll([[f'--model={lib.TINY}', f'--logdir={logdir}', *flags]
                          for flags, _ in cases])
  for (flags, expected), (rc, out, err) in zip(cases, results):
    assert rc == 2, (flags, err[-3000:])
    lines = [l for l in err.splitlines() if l.startswith('error:')]
    assert len(lines) == 1 and expected in lines[0], (flags, err[-3000:])
    assert 'Traceback' not in err + out
    assert not os.path.exists(logdir), flags
