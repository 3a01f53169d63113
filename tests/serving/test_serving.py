"""Serving: inference subgraphs, the exports, the same numbers as training.

The done-when tests of issue 61: a model trained pipelined on 2 devices
under '1f1b' is exported both ways (the trainer's
--mode=write_inference_graph for Lingvo's Predictor, and lingvo-ext-export's
SavedModel); then, each in a fresh process on one CPU device, the evaler and
the Predictor (tests/support/serving_probe.py lingvo) and the SavedModel without
Lingvo (serving_probe.py saved_model) score the same dev batch.
"""

import json
import os
import subprocess
import sys

import lingvo.compat as tf
import numpy as np
import pytest

from lingvo_ext.serving import export
from lingvo_ext.serving import inference
from lingvo_ext.serving import saved_model
from lingvo_ext.tasks.lm import generate
from tests.support import ROOT
from tests.support import zygote

PROBE = os.path.join(ROOT, 'tests', 'support', 'serving_probe.py')
TIMEOUT = 600
ONE_CPU = {'CUDA_VISIBLE_DEVICES': '', 'TF_CPP_MIN_LOG_LEVEL': '2'}


def _Run(args, env=None, fresh=False):
  """A lingvo_ext command (forked from the zygote unless `fresh`)."""
  full_env = dict(os.environ, **(env or {}))
  run = subprocess.run if fresh else zygote.run
  proc = run([sys.executable, *args], cwd=ROOT, env=full_env,
             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
             timeout=TIMEOUT, check=False)
  return proc.returncode, proc.stdout


def _Train(logdir, model, extra=(), env=None):
  code, out = _Run(['-m', 'lingvo_ext.trainer', f'--model={model}',
                    f'--logdir={logdir}', '--num_cpu_devices=2',
                    '--worker_split_size=2', *extra], env)
  assert code == 0, out[-5000:]


def _Probe(mode, tmp, env=None, **args):
  """Runs serving_probe.py `mode` in a fresh process; its npz as a dict."""
  args['out'] = str(tmp / f'{mode}.npz')
  path = tmp / f'{mode}.json'
  path.write_text(json.dumps(args))
  code, out = _Run([PROBE, mode, str(path)], dict(ONE_CPU, **(env or {})),
                   fresh=True)
  assert code == 0, out[-5000:]
  return dict(np.load(args['out']))


def _ExportBothWays(logdir, model, export_dir, extra=(), env=None):
  code, out = _Run(['-m', 'lingvo_ext.trainer', f'--model={model}',
                    f'--logdir={logdir}', '--mode=write_inference_graph',
                    *extra], env)
  assert code == 0, out[-5000:]
  graph = os.path.join(logdir, 'inference_graphs', 'inference.pbtxt')
  assert os.path.exists(graph)
  assert 'skipped the TPU inference graph' in out
  assert 'Traceback' not in out
  code, out = _Run(['-m', 'lingvo_ext.tools.export', f'--model={model}',
                    f'--logdir={logdir}', f'--export_dir={export_dir}',
                    *extra], env)
  assert code == 0, out[-5000:]
  return graph


_LM = 'lm.TransformerLmTinyGPipe'


def _RestBody():
  """The JSON request body docs/serving.md shows for TF Serving."""
  with open(os.path.join(ROOT, 'docs', 'serving.md')) as f:
    page = f.read()
  block = page.split('<!-- serving: rest-body -->', 1)[1]
  return json.loads(block.split('```json', 1)[1].split('```', 1)[0])
_1F1B = ['--model_params_override=task.schedule:"1f1b";'
         'train.save_interval_seconds:3600', '--max_steps=3']


@pytest.fixture(scope='module')
def lm_run(tiny_gpipe_run, tmp_path_factory):
  """tiny_gpipe_run (conftest.py: _LM trained 3 steps on 2 devices under
  '1f1b'), exported both ways from a copy of its logdir."""
  assert tiny_gpipe_run.model == _LM
  tmp = tmp_path_factory.mktemp('serving_lm')
  logdir = tiny_gpipe_run.Copy(str(tmp / 'logdir'))
  export_dir = str(tmp / 'export')
  graph = _ExportBothWays(logdir, _LM, export_dir)
  return tmp, logdir, graph, export_dir


@pytest.mark.e2e
def testLmPredictorSavedModelAndEvalerAgree(lm_run):
  tmp, logdir, graph, export_dir = lm_run
  ckpt = export.NewestCompleteCheckpoint(os.path.join(logdir, 'train'))
  assert ckpt.endswith('ckpt-00000003')
  prefix = 8
  lv = _Probe('lingvo', tmp, model=_LM, checkpoint=ckpt, kind='lm',
              inference_graph=graph, prefix_len=prefix)
  body = _RestBody()
  sm = _Probe('saved_model', tmp, export_dir=export_dir, kind='lm',
              batch=str(tmp / 'lingvo.npz'), prefix_len=prefix,
              rest_body=body)
  assert list(sm['signatures']) == ['default', 'generate', 'serving_default']
  weights = lv['batch_weights']
  assert weights.sum() > 0
  # The evaler's per-example loss, by Lingvo's Predictor and the SavedModel.
  np.testing.assert_allclose(lv['predictor_per_example_log_pplx'],
                             lv['evaler_loss'], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sm['saved_per_example_log_pplx'],
                             lv['evaler_loss'], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sm['saved_log_probs'], lv['predictor_log_probs'],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      sm['saved_per_example_log_prob'],
      (sm['saved_log_probs'] * weights).sum(1), rtol=1e-5, atol=1e-5)
  assert (sm['saved_log_probs'][weights == 0] == 0).all()
  # generate: greedy and sampled pick the decoder's tokens; a seed repeats.
  np.testing.assert_array_equal(lv['predictor_greedy'], lv['decoder_greedy'])
  np.testing.assert_array_equal(sm['saved_greedy'], lv['decoder_greedy'])
  np.testing.assert_array_equal(lv['predictor_sampled'],
                                lv['decoder_sampled'])
  np.testing.assert_array_equal(sm['saved_sampled'], lv['decoder_sampled'])
  np.testing.assert_array_equal(sm['saved_sampled_again'],
                                sm['saved_sampled'])
  np.testing.assert_array_equal(sm['saved_greedy_prefix'],
                                lv['batch_ids'][:, :prefix])
  assert not np.array_equal(sm['saved_greedy'], sm['saved_sampled'])
  # docs/serving.md's TF Serving request body fits the signature.
  assert sm['rest_outputs'].shape == (len(body['inputs']['prefix']),
                                      body['inputs']['max_len'])
  np.testing.assert_array_equal(sm['rest_outputs'][:, :4],
                                body['inputs']['prefix'])
  # The vocabulary the model trained with, as the SavedModel's asset.
  with open(os.path.join(logdir, 'train', 'vocab.json')) as f:
    assert str(sm['vocab']) == f.read()


_IMAGE = 'image.ConvClassifierTinyGPipe'


@pytest.mark.e2e
def testImagePredictorSavedModelAndEvalerAgree(tmp_path):
  logdir = str(tmp_path / 'logdir')
  _Train(logdir, _IMAGE, _1F1B)
  export_dir = str(tmp_path / 'export')
  graph = _ExportBothWays(logdir, _IMAGE, export_dir)
  ckpt = export.NewestCompleteCheckpoint(os.path.join(logdir, 'train'))
  lv = _Probe('lingvo', tmp_path, model=_IMAGE, checkpoint=ckpt,
              kind='image', inference_graph=graph)
  sm = _Probe('saved_model', tmp_path, export_dir=export_dir, kind='image',
              batch=str(tmp_path / 'lingvo.npz'))
  assert list(sm['signatures']) == ['default', 'serving_default']
  labels = lv['batch_label']
  rows = np.arange(len(labels))
  for probs in (lv['predictor_probs'], sm['saved_probs']):
    np.testing.assert_allclose(-np.log(probs[rows, labels]),
                               lv['evaler_loss'], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(sm['saved_probs'], lv['predictor_probs'],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(sm['saved_top_class'],
                                lv['predictor_top_class'])
  np.testing.assert_array_equal(sm['saved_top_class'],
                                sm['saved_probs'].argmax(-1))
  np.testing.assert_allclose(sm['saved_probs_batch1'], sm['saved_probs'][:1],
                             rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
def testLingvoTaskLmRewrittenByTheTrainerAgrees(tmp_path, lingvo_lm_run):
  # lingvo_lm_run (conftest.py): Lingvo's GPipe LM trained 2 steps on 2
  # devices under '1f1b'; exported from a copy.
  assert '--num_cpu_devices=2' in lingvo_lm_run.flags
  env = {'PYTHONPATH': lingvo_lm_run.pythonpath}
  model = lingvo_lm_run.model
  logdir = lingvo_lm_run.Copy(str(tmp_path / 'logdir'))
  export_dir = str(tmp_path / 'export')
  graph = _ExportBothWays(logdir, model, export_dir, env=env)
  ckpt = export.NewestCompleteCheckpoint(os.path.join(logdir, 'train'))
  lv = _Probe('lingvo', tmp_path, env, model=model, checkpoint=ckpt,
              kind='lingvo_lm', inference_graph=graph)
  # Lingvo's tokenizer ops are all its SavedModel needs of Lingvo.
  import lingvo  # pylint: disable=g-import-not-at-top
  ops = os.path.join(os.path.dirname(lingvo.__file__), 'core', 'ops',
                     'x_ops.so')
  sm = _Probe('saved_model', tmp_path, export_dir=export_dir,
              kind='lingvo_lm', batch=str(tmp_path / 'lingvo.npz'),
              op_library=ops)
  per_token = lv['predictor_log_pplx_per_sample'] / lv['predictor_lengths']
  np.testing.assert_allclose(per_token, lv['evaler_loss'], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(sm['saved_log_pplx_per_sample'],
                             lv['predictor_log_pplx_per_sample'], rtol=1e-5,
                             atol=1e-5)


# --- Bad input: one `error:` line, exit 2, nothing written (in-process). ---


def _Export(capsys, *argv):
  code = export.main(list(argv))
  err = capsys.readouterr().err.strip().splitlines()
  return code, err


@pytest.mark.e2e
def testBadInputIsOneErrorLineAndWritesNothing(tiny_gpipe_run, tmp_path,
                                                 capsys):
  logdir = tiny_gpipe_run.logdir
  out = str(tmp_path / 'out')
  empty = tmp_path / 'empty'
  (empty / 'train').mkdir(parents=True)
  ckpt = export.NewestCompleteCheckpoint(os.path.join(logdir, 'train'))
  cases = [
      (['--model=lm.TransformerLmTinyGPipe', f'--logdir={empty}',
        f'--export_dir={out}'], 'no complete checkpoint in'),
      (['--model=image.ConvClassifierTiny', f'--checkpoint={ckpt}',
        f'--export_dir={out}'], 'lacks image/'),
      (['--model=lm.TransformerLmTinyGPipe', f'--logdir={logdir}',
        f'--export_dir={out}', '--subgraphs=default,beam'],
       "no subgraph 'beam'"),
      (['--model=lm.TransformerLmTinyGPipe', f'--logdir={logdir}'],
       '--export_dir is required'),
      (['--model=lm.NoSuchModel', f'--logdir={logdir}',
        f'--export_dir={out}'], 'lm.NoSuchModel'),
      (['--model=lm.TransformerLmTinyGPipe', f'--logdir={logdir}',
        f'--checkpoint={ckpt}', f'--export_dir={out}'], 'pass one of'),
      (['--model=lm.TransformerLmTinyGPipe', f'--logdir={logdir}',
        f'--export_dir={out}', '--no_such_flag'], 'no_such_flag'),
  ]
  for argv, expected in cases:
    code, err = _Export(capsys, *argv)
    assert code == 2, (argv, err)
    assert err[0].startswith('error: '), (argv, err)
    # One line, but for the trainer's list of close model names.
    assert len(err) == 1 or 'NoSuchModel' in err[0], (argv, err)
    assert expected in err[0], (argv, err)
    assert not os.path.exists(out), argv
  assert os.listdir(tmp_path) == ['empty']
  # An existing --export_dir: refused, untouched; replaced with --overwrite.
  os.makedirs(out)
  keep = os.path.join(out, 'keep.txt')
  open(keep, 'w').close()
  code, err = _Export(capsys, '--model=lm.TransformerLmTinyGPipe',
                      f'--logdir={logdir}', f'--export_dir={out}',
                      '--subgraphs=default')
  assert code == 2 and 'exists' in err[0] and '--overwrite' in err[0], err
  assert os.listdir(out) == ['keep.txt']
  code, err = _Export(capsys, '--model=lm.TransformerLmTinyGPipe',
                      f'--logdir={logdir}', f'--export_dir={out}',
                      '--subgraphs=default', '--overwrite')
  assert code == 0, err
  assert sorted(os.listdir(out)) == [
      'assets', 'fingerprint.pb', 'inference.pbtxt', 'saved_model.pb',
      'variables']
  assert sorted(os.listdir(tmp_path)) == ['empty', 'out']  # No staging left.


def testSequentialParamsIsOneCellOneMicroBatchWithoutDropout():
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  cfg = experiment_params.GetParams(
      'lm.TransformerLmTinyGPipe', 'Train',
      'task.schedule:"1f1b";task.stack_variables:True;'
      'task.fprop_dtype:bfloat16')
  seq = inference.SequentialParams(cfg)
  assert (cfg.task.num_partitions, cfg.task.num_micro_batches) == (2, 2)
  assert (seq.task.num_partitions, seq.task.num_micro_batches) == (1, 1)
  assert not seq.task.stack_variables
  assert seq.task.fprop_dtype == cfg.task.fprop_dtype  # As trained.
  sharded = experiment_params.GetParams('lm.WordLmShardedTiny', 'Train')
  assert sharded.task.partitioner is not None
  assert inference.SequentialParams(sharded).task.partitioner is None
  from lingvo.core import layers_with_attention  # pylint: disable=g-import-not-at-top

  from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
  ffn = layers_with_attention.TransformerFeedForwardLayer.Params().Set(
      name='f', input_dim=2, hidden_dim=2, residual_dropout_prob=0.5,
      relu_dropout_prob=0.25)
  p = gpipe.PipeliningLayer.Params().Set(
      name='p', num_micro_batches=4, cell_tpl=[ffn])
  seq = inference.SequentialParams(p)
  assert seq.num_micro_batches == 1 and p.num_micro_batches == 4
  assert seq.cell_tpl[0].residual_dropout_prob == 0.0
  assert seq.cell_tpl[0].relu_dropout_prob == 0.0
  assert p.cell_tpl[0].residual_dropout_prob == 0.5


def testInferenceGraphHoldsNoPipelineOpsAndTheTrainingNames():
  tf.flags.FLAGS([sys.argv[0]])
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  model = 'lm.TransformerLmTinyGPipe'
  cfg = inference.InferenceParams(model, 'task.schedule:"1f1b"')
  asserts = tf.flags.FLAGS['enable_asserts']
  assert asserts.value and asserts.using_default_value
  proto = saved_model.InferenceGraph(cfg)
  # Lingvo's exporter turns the flag off; the caller's later builds keep
  # their asserts (it left 4 of the LM's out of a later test's graph).
  assert asserts.value and asserts.using_default_value
  assert sorted(proto.subgraphs) == ['default', 'generate']
  assert saved_model.CountOps(proto.graph_def,
                              saved_model.PIPELINE_OP_TYPES) == 0
  # The one call it leaves out: generate's XLA-compiled loop.
  calls = [n for n in proto.graph_def.node
           if n.op in saved_model.PIPELINE_OP_TYPES]
  assert [(generate.FUNCTION_NAME in n.attr['f'].func.name,
           n.attr['_XlaMustCompile'].b) for n in calls] == [(True, True)]
  devices = {n.device for n in proto.graph_def.node}
  assert devices <= {''}, devices
  # The pipelined training graph does hold them: the count can fail.
  train = experiment_params.GetParams(model, 'Train', 'task.schedule:"1f1b"')
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default() as g, cluster_factory.Cluster(train.cluster):
    task = train.Instantiate().GetTask()
    task.FPropDefaultTheta()
    names = {v.op.name for v in tf.global_variables()}
  assert saved_model.CountOps(g.as_graph_def(),
                              saved_model.PIPELINE_OP_TYPES) > 0
  assert set(saved_model.GraphVariables(proto.graph_def)) <= names
