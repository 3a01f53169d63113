"""Lingvo's own GPipe models (built by Lingvo's task code) on lingvo_ext's engine.

The experiment is a user's module outside the repository: Lingvo's
`BatchMajorLanguageModel` with `GPipeTransformerLm.CommonParams(...)`, fed
by Lingvo's `LmInput` on a text file; and a stack from Lingvo's
`batch_major_attention.Builder` with num_splits/num_micro_batches, whose
`_MaybeSplit` builds `lingvo.core.gpipe.PipeliningLayer` params.
"""

import os
import re
import subprocess
import sys

import lingvo.compat as tf
from lingvo.core import batch_major_attention
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import layers_with_gpipe as lingvo_layers_with_gpipe
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext import trainer
from lingvo_ext.core import from_lingvo
from lingvo_ext.core import gpipe
from lingvo_ext.core import layers_with_gpipe
from lingvo_ext.core import precision
from lingvo_ext.pipeline import schedules
from lingvo_ext.preflight import param_checks
from lingvo_ext.runtime import trainer_flags
from lingvo_ext.tasks import experiment_params
from lingvo_ext.tasks import pipeline_tree
from tests.support import ROOT
from tests.support import builder_stack_testlib
from tests.support import gpipe_testlib
from tests.support import lingvo_lm_testlib
from tests.support import zygote

TIMEOUT = 600
MODEL = lingvo_lm_testlib.MODEL

BUILDER_MODEL = builder_stack_testlib.MODEL


@pytest.fixture(scope='module')
def experiment(tmp_path_factory):
  """The experiment's directory (for PYTHONPATH), registered in-process."""
  exp_dir = tmp_path_factory.mktemp('lingvo_gpipe_exp')
  lingvo_lm_testlib.Write(exp_dir)
  builder_stack_testlib.Write(exp_dir)
  sys.path.insert(0, str(exp_dir))
  yield exp_dir
  sys.path.remove(str(exp_dir))


def _Run(args, exp_dir, env=None):
  full_env = dict(os.environ, PYTHONPATH=str(exp_dir), **(env or {}))
  proc = zygote.run([sys.executable, '-m', 'lingvo_ext.trainer', *args],
                    cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
                    check=False)
  return proc.returncode, proc.stdout


def _Errors(out):
  return [line for line in out.splitlines() if line.startswith('error:')]


def _VarShapes(cfg):
  with tf.Graph().as_default():
    model = cfg.Instantiate()
    return sorted((v.op.name, tuple(v.shape.as_list()))
                  for v in model.GetTask().vars.Flatten())


def testFromLingvoSwapsEveryLingvoGPipeLayerOfTheLm(experiment):
  del experiment
  lingvo_cfg = experiment_params.GetParams(MODEL, 'Train',
                                          gpipe_engine='lingvo')
  stack = lingvo_cfg.task.lm.stack
  assert stack.cls is lingvo_layers_with_gpipe.GPipeBatchMajorTransformerStack
  cfg = from_lingvo.FromLingvo(lingvo_cfg)
  ext = cfg.task.lm.stack
  assert ext.cls is layers_with_gpipe.GPipeBatchMajorTransformerStack
  assert issubclass(ext.cls, gpipe.PipeliningLayer)
  assert ext.emb_tpl.cls is (
      layers_with_gpipe.GPipeBatchMajorTransformerEmbeddingLayer)
  assert ext.softmax_tpl.cls is (
      layers_with_gpipe.GPipeBatchMajorTransformerSoftmaxLayer)
  # The same values; lingvo_ext's own switches at their defaults.
  assert (ext.splits, ext.num_micro_batches, ext.num_encoder_layers,
          ext.model_dim) == (2, 4, 4, 64)
  assert ext.encoder_tpl.ToText() == stack.encoder_tpl.ToText()
  assert ext.schedule == 'unrolled'
  # The input tree is left as it was; the registry's default is the same.
  assert stack.cls is lingvo_layers_with_gpipe.GPipeBatchMajorTransformerStack
  assert from_lingvo.CountLingvoLayers(lingvo_cfg) == 3
  assert from_lingvo.CountLingvoLayers(cfg) == 0
  assert experiment_params.GetParams(MODEL, 'Train').ToText() == cfg.ToText()
  # The same variables as the model Lingvo's params build.
  assert _VarShapes(cfg) == _VarShapes(lingvo_cfg)
  assert [path for path, _ in pipeline_tree.Pipelines(cfg)] == [
      'task.lm.stack']


def _BuilderStack():
  builder = batch_major_attention.Builder.Params().Set(
      model_dim=16, num_heads=2, ff_hidden_dim=32, num_splits=2,
      num_micro_batches=2, deterministic_dropout=True).Instantiate()
  return builder.TransformerEncoderStack('stack', num_layers=2)


def _RunStack(p, save=None, restore=None, devices=2):
  """(loss, gradients, variable names) of one step of stack `p`."""
  g = tf.Graph()
  with g.as_default(), gpipe_testlib.Cluster(devices):
    py_utils.GetOrCreateGlobalStepVar()
    net = p.Instantiate()
    rng = np.random.RandomState(0)
    inputs = py_utils.NestedMap(
        vec=tf.constant(rng.randn(4, 5, 16).astype(np.float32)),
        paddings=tf.zeros([4, 5], tf.float32))
    loss = gpipe_testlib._Loss(net.FPropDefaultTheta(inputs).vec)  # pylint: disable=protected-access
    variables = net.vars.Flatten()
    grads = tf.gradients(loss, variables)
    init = tf.global_variables_initializer()
    saver = tf.train.Saver(variables)
  with gpipe_testlib.Session(g, devices) as sess:
    sess.run(init)
    if restore:
      saver.restore(sess, restore)
    else:
      gpipe_testlib.LoadSeededWeights(sess, variables)
    if save:
      saver.save(sess, save)
    loss_value, grad_values = sess.run([loss, grads])
  return loss_value, grad_values, sorted(v.op.name for v in variables)


def testBuilderStackRestoresAcrossEngines(tmp_path):
  lingvo_p = _BuilderStack()
  assert lingvo_p.cls is lingvo_gpipe.PipeliningLayer
  ext_p = from_lingvo.FromLingvo(lingvo_p)
  assert ext_p.cls is gpipe.PipeliningLayer
  assert ext_p.nested_map_fprop and ext_p.num_micro_batches == 2
  # A checkpoint of Lingvo's engine restores into lingvo_ext's and back.
  lingvo_ckpt = str(tmp_path / 'lingvo')
  loss, grads, names = _RunStack(lingvo_p, save=lingvo_ckpt)
  ext_ckpt = str(tmp_path / 'ext')
  ext_loss, ext_grads, ext_names = _RunStack(
      ext_p, save=ext_ckpt, restore=lingvo_ckpt)
  assert ext_names == names
  np.testing.assert_allclose(ext_loss, loss, rtol=1e-5)
  back_loss, _, _ = _RunStack(lingvo_p, restore=ext_ckpt)
  np.testing.assert_allclose(back_loss, loss, rtol=1e-5)
  for a, b in zip(ext_grads, grads):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def testBuilderStackMatchesLingvoUnderEverySchedule(tmp_path):
  lingvo_p = _BuilderStack()
  lingvo_ckpt = str(tmp_path / 'lingvo')
  loss, grads, _ = _RunStack(lingvo_p, save=lingvo_ckpt)
  ext_p = from_lingvo.FromLingvo(lingvo_p)
  # Every schedule of lingvo_ext's engine: Lingvo's loss and gradients.
  for schedule in sorted(set(schedules.SCHEDULES) - {'unrolled'}):
    # 'zbv' places two cells on each device: the 2 cells on one.
    s_loss, s_grads, _ = _RunStack(ext_p.Copy().Set(schedule=schedule),
                                   restore=lingvo_ckpt,
                                   devices=1 if schedule == 'zbv' else 2)
    np.testing.assert_allclose(s_loss, loss, rtol=1e-5, err_msg=schedule)
    for a, b in zip(s_grads, grads):
      np.testing.assert_allclose(a, b, atol=1e-5, err_msg=schedule)


def testScheduleOverrideAtTheTaskNamesThePipelinesPath(experiment):
  del experiment
  with pytest.raises(experiment_params.OverrideError) as e:
    experiment_params.GetParams(MODEL, 'Train', 'task.schedule:"1f1b"')
  assert 'Did you mean `task.lm.stack.schedule`?' in str(e.value)
  assert '\n' not in str(e.value)
  cfg = experiment_params.GetParams(MODEL, 'Train',
                                    'task.lm.stack.schedule:"1f1b"')
  assert cfg.task.lm.stack.schedule == '1f1b'
  # Lingvo's engine has no schedule switch.
  with pytest.raises(experiment_params.OverrideError):
    experiment_params.GetParams(MODEL, 'Train', 'task.lm.stack.schedule:"1f1b"',
                                gpipe_engine='lingvo')


def testTheGuidesOverridesSetWhatTheyNameOnTheLingvoLm(experiment):
  del experiment
  with open(os.path.join(ROOT, 'docs', 'coming-from-lingvo.md')) as f:
    texts = re.findall(r"--model_params_override='([^']*)'", f.read())
  assert len(texts) >= 4, texts
  for text in texts:
    cfg = experiment_params.GetParams(MODEL, 'Train', text)
    for item in text.split(';'):
      key, value = item.strip().split(':', 1)
      got = cfg.Get(key)
      assert str(got) == value.strip('"') or (
          value == 'bfloat16' and got == tf.bfloat16), (text, got)


def _Options(override='', **kwargs):
  return trainer_flags.Options(model=MODEL, logdir='/nonexistent/x',
                               run_locally='cpu',
                               model_params_override=override, **kwargs)


def testTrainerChecksEveryPipelineOfTheTree(experiment):
  del experiment
  error, _ = param_checks.Check(_Options())
  assert error is None
  for override, words in (
      ('task.lm.stack.num_micro_batches:3',
       ['task.lm.stack', 'input batch 8', 'num_micro_batches=3',
        '[1, 2, 4, 8]']),
      ('task.lm.stack.schedule:"gpipe"', ['task.lm.stack', "'gpipe'"]),
      ('input.fixed_input_shape:False',
       ["--model_params_override='input.fixed_input_shape:True'"]),
      ('input.file_pattern:"text:/nonexistent/*.txt"',
       ['no file matches', '/nonexistent/*.txt'])):
    error, _ = param_checks.Check(_Options(override))
    assert error and '\n' not in error, (override, error)
    for word in words:
      assert word in error, (override, error)
    # The override the line suggests makes the check pass.
    fix = re.findall(r"--model_params_override='([^']*)'", error)
    if fix and 'fixed_input_shape' in fix[0]:
      error, _ = param_checks.Check(
          _Options(override + ';' + fix[0]))
      assert error is None, error


def testTimeMajorLanguageModelIsOneLineNamingBatchMajor(experiment):
  del experiment
  o = trainer_flags.Options(model=MODEL + 'TimeMajor', logdir='/nonexistent/x',
                            run_locally='cpu')
  error, _ = param_checks.Check(o)
  assert error and '\n' not in error
  assert '(LanguageModel) feeds task.lm (GPipeTransformerLm)' in error
  assert 'BatchMajorLanguageModel.Params()' in error


def testBf16OnALingvoTaskWarnsAndTakesTheWorkAround(experiment, capsys,
                                                    monkeypatch):
  del experiment
  monkeypatch.setattr(precision, '_warned', [])
  monkeypatch.setattr(precision, 'OneDnnEnabled', lambda: True)
  error, o = param_checks.Check(
      _Options('task.fprop_dtype:bfloat16'))
  assert error is None
  expected = precision.SlowBf16Warning(tf.bfloat16)
  assert capsys.readouterr().err == (expected + '\n' if expected else '')
  assert o.grappler_remapping is False  # precision.RemapperOff
  cfg = experiment_params.GetParams(MODEL, 'Train', 'task.fprop_dtype:bfloat16')
  assert cfg.task.fprop_dtype == tf.bfloat16


@pytest.mark.e2e
def testLingvoLmTrainsOnLingvoExtWithScheduleOverride(experiment, tmp_path,
                                                      lingvo_lm_run):
  # lingvo_lm_run (conftest.py): MODEL trained 2 steps on lingvo_ext's engine
  # with task.lm.stack.schedule:"1f1b".
  assert lingvo_lm_run.model == MODEL
  assert '--gpipe_engine=lingvo_ext' in lingvo_lm_run.flags
  out = lingvo_lm_run.output
  assert 'step 2/2' in out, out[-3000:]
  logdir = lingvo_lm_run.Copy(str(tmp_path / 'logdir'))
  ckpt = tf.train.latest_checkpoint(os.path.join(logdir, 'train'))
  assert ckpt.endswith('ckpt-00000002')
  keys = {name for name, _ in tf.train.list_variables(ckpt)}
  lingvo_cfg = experiment_params.GetParams(MODEL, 'Train',
                                          gpipe_engine='lingvo')
  # The checkpoint holds Lingvo's variables under Lingvo's names.
  names = {name for name, _ in _VarShapes(lingvo_cfg)}
  assert names <= keys
  assert not {k for k in keys - names
              if not k.endswith(('/Adam', '/Adam_1')) and
              k not in ('global_step', 'beta1_power', 'beta2_power')}, keys
  # A decoder on a task with no decoder: refused in a line, up front.
  rc, out = _Run([f'--model={MODEL}', f'--logdir={logdir}',
                  '--job=decoder_dev'], experiment)
  assert rc == 2, out[-3000:]
  assert _Errors(out) == [
      'error: --job=decoder_dev: task lm (BatchMajorLanguageModel) has no '
      'decoder (its CreateDecoderMetrics is empty): nothing to decode; '
      '--job=evaler_dev evaluates its loss.'], out[-3000:]


@pytest.mark.e2e
def testMismatchAndEmptyInputAreOneLineAndWriteNothing(experiment, tmp_path):
  logdir = tmp_path / 'logdir'
  rc, out = _Run([f'--model={MODEL}', f'--logdir={logdir}',
                  '--model_params_override=task.lm.stack.num_micro_batches:3'],
                 experiment)
  assert rc == 2, out[-3000:]
  assert len(_Errors(out)) == 1 and 'num_micro_batches=3' in out, out
  assert 'Traceback' not in out and not logdir.exists()
  empty = tmp_path / 'empty.txt'
  empty.write_text('')
  rc, out = _Run([f'--model={MODEL}', f'--logdir={logdir}'], experiment,
                 env={'LINGVO_GPIPE_LM_DATA': str(empty)})
  assert rc == 2, out[-3000:]
  assert len(_Errors(out)) == 1 and 'empty' in _Errors(out)[0], out
  assert 'Traceback' not in out and not logdir.exists()


def testPlannerPlansTheLingvoLmsPipelineWithItsCells(experiment, capsys):
  del experiment
  import json  # pylint: disable=g-import-not-at-top

  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  assert plan_tool.main([f'--model={MODEL}', '--devices=2', '--json']) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  [pipe] = out['pipelines']
  assert (pipe['path'], pipe['cls'], pipe['cells']) == (
      'task.lm.stack', 'GPipeBatchMajorTransformerStack', 2)
  # Every plan keeps the experiment's 2 cells (their variable names), on
  # one replica, with micro-batches dividing the input batch 8.
  assert {(p['num_cells'], p['replicas']) for p in pipe['plans']} == {(2, 1)}
  assert {p['num_micro_batches'] for p in pipe['plans']} <= {1, 2, 4, 8}
  best = pipe['best']
  assert pipe['overrides'] == {
      'task.lm.stack.num_micro_batches': best['num_micro_batches'],
      'task.lm.stack.schedule': best['schedule'],
      'task.lm.stack.recompute': pipe['overrides']['task.lm.stack.recompute']}
  assert out['trainer_flags'] == [
      '--num_cpu_devices=%d' % best['devices_per_replica'],
      '--worker_split_size=%d' % best['devices_per_replica']]
  # The override it prints sets what it names.
  cfg = experiment_params.GetParams(MODEL, 'Train',
                                    out['model_params_override'])
  assert cfg.task.lm.stack.schedule == best['schedule']
  assert cfg.task.lm.stack.num_micro_batches == best['num_micro_batches']
  # The profile's cells hold the stack's variables, split as Lingvo cuts it.
  [profiled] = tree.ProfileTree(
      experiment_params.GetParams(MODEL, 'Train'), MODEL)
  with tf.Graph().as_default():
    stack = experiment_params.GetParams(MODEL, 'Train').task.lm.stack.Set(
        name='stack').Instantiate()
    for name, cell in stack.Cells():
      [layer] = [l for l in profiled.profile.layers if l.name == name]
      assert layer.param_bytes == sum(
          v.shape.num_elements() * v.dtype.size for v in cell.vars.Flatten())
      assert layer.flops > 0 and layer.fwd_ops > 0 and layer.bwd_ops > 0
  assert profiled.profile.batch == 8
  # Lingvo's engine has no switches to plan.
  error, _, _ = trainer._AutoPlan(  # pylint: disable=protected-access
      _Options(plan='auto', num_cpu_devices=2, gpipe_engine='lingvo'),
      experiment_params.GetParams(MODEL, 'Train', gpipe_engine='lingvo'))
  assert error.startswith('--plan=auto plans lingvo_ext') and '\n' not in error


def testPlannerPlansTheBuilderStacksPipeline(experiment, capsys):
  del experiment
  from lingvo_ext.tools import plan as plan_tool  # pylint: disable=g-import-not-at-top
  assert plan_tool.main([f'--model={BUILDER_MODEL}', '--devices=2']) == 0
  out = capsys.readouterr().out
  assert ('plans for task.stack (PipeliningLayer, its 2 cells as the '
          'experiment cuts them) on 2 devices') in out, out
  trainer_cmd = '.venv/bin/python -m lingvo_ext.trainer'
  [command] = [l.strip() for l in out.splitlines()
               if l.strip().startswith(trainer_cmd)]
  override = re.search(r"--model_params_override='([^']*)'", command).group(1)
  cfg = experiment_params.GetParams(BUILDER_MODEL, 'Train', override)
  assert cfg.task.stack.cls is gpipe.PipeliningLayer
  assert f'task.stack.schedule:"{cfg.task.stack.schedule}"' in override
  # Refused flags are one line each.
  for flag in ('--measure', '--global_batch=16'):
    assert plan_tool.main([f'--model={BUILDER_MODEL}', '--devices=2',
                           flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: ' + flag.split('=')[0]) and err.count(
        '\n') == 1, err


@pytest.mark.e2e
@pytest.mark.parametrize('model,path', [(MODEL, 'task.lm.stack'),
                                        (BUILDER_MODEL, 'task.stack')])
def testPlanAutoTrainsTheLingvoExperiment(experiment, tmp_path, model, path):
  logdir = tmp_path / 'logdir'
  rc, out = _Run([f'--model={model}', f'--logdir={logdir}', '--max_steps=2',
                  '--plan=auto', '--devices=2'], experiment)
  assert rc == 0, out[-3000:]
  [line] = [l for l in out.splitlines() if l.startswith('--plan=auto chose')]
  assert line.startswith(f'--plan=auto chose {path} K2xR1 M'), line
  losses = [float(x) for x in re.findall(r'step \d+/2\s+loss (\S+)', out)]
  assert len(losses) == 2 and np.all(np.isfinite(losses)), out[-3000:]
  # The plan's values are the trained params'.
  override = re.search(r"--model_params_override='([^']*)'", line).group(1)
  with open(logdir / 'control' / 'params.txt') as f:
    params = f.read()
  for item in override.split(';'):
    key, value = item.strip().split(':', 1)
    # params.txt writes None as Lingvo's text form does: NoneType.
    value = 'NoneType' if value == 'None' else value.replace('"', "'")
    assert re.search(r'^%s : %s$' % (re.escape(key), re.escape(value)),
                     params, re.M), (item, line)


@pytest.mark.e2e
@pytest.mark.parametrize('schedule', sorted(schedules.SCHEDULES))
def testBuilderExperimentTrainsUnderEachSchedule(experiment, tmp_path,
                                                 schedule):
  # 'zbv' places two cells on each device: the 2 cells on one.
  devices = 1 if schedule == 'zbv' else 2
  rc, out = _Run([f'--model={BUILDER_MODEL}', f'--logdir={tmp_path / "ld"}',
                  '--max_steps=2', '--gpipe_engine=lingvo_ext',
                  f'--num_cpu_devices={devices}',
                  f'--worker_split_size={devices}',
                  f'--model_params_override=task.stack.schedule:"{schedule}"'],
                 experiment)
  assert rc == 0, out[-3000:]
  losses = [float(x) for x in re.findall(r'step \d+/2\s+loss (\S+)', out)]
  assert len(losses) == 2 and np.all(np.isfinite(losses)), out[-3000:]
  ckpt = tf.train.latest_checkpoint(str(tmp_path / 'ld' / 'train'))
  keys = {name for name, _ in tf.train.list_variables(ckpt)}
  # Lingvo's variable names, as its engine's params build them.
  lingvo_cfg = experiment_params.GetParams(BUILDER_MODEL, 'Train',
                                           gpipe_engine='lingvo')
  assert lingvo_cfg.task.stack.cls is lingvo_gpipe.PipeliningLayer
  assert {name for name, _ in _VarShapes(lingvo_cfg)} <= keys


@pytest.mark.e2e
def testBuilderCheckpointOfOneEngineTrainsOnTheOther(experiment, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  flags = [f'--model={BUILDER_MODEL}', '--num_cpu_devices=2',
           '--worker_split_size=2']
  base = tmp_path / 'base'
  rc, out = _Run(flags + [f'--logdir={base}', '--max_steps=2'], experiment)
  assert rc == 0, out[-3000:]
  # Step 3 from lingvo_ext's step-2 checkpoint, on each engine.
  losses = {}
  for engine in ('lingvo_ext', 'lingvo'):
    logdir = tmp_path / engine
    shutil.copytree(base, logdir,
                    ignore=shutil.ignore_patterns('trainer.lock'))
    rc, out = _Run(flags + [f'--logdir={logdir}', '--max_steps=3',
                            f'--gpipe_engine={engine}'], experiment)
    assert rc == 0, (engine, out[-3000:])
    [loss] = re.findall(r'step 3/3\s+loss (\S+)', out) or [None]
    assert loss is not None, (engine, out[-3000:])
    losses[engine] = float(loss)
  np.testing.assert_allclose(losses['lingvo'], losses['lingvo_ext'],
                             rtol=1e-4)
