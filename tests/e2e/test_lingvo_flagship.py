"""Lingvo's flagship LM experiment (scaled down) in every job.

The experiment is tests/support/flagship_testlib.py's copy of Lingvo's
`OneBWdsGPipeTransformer` with its bucket tables, batch-major and
time-major, on its dataset layout rebuilt from Python's own text.
"""

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lingvo_ext.tasks import experiment_params
from tests.support import ROOT
from tests.support import flagship_testlib
from tests.support import zygote

TIMEOUT = 300


flagship = pytest.fixture(scope='module', name='flagship')(
    flagship_testlib.Fixture)


def _Run(root, args, **env):
  proc = zygote.run([sys.executable, '-m', 'lingvo_ext.trainer', *args],
                    cwd=ROOT, env=flagship_testlib.Env(root, **env),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, timeout=TIMEOUT, check=False)
  return proc.returncode, proc.stdout


def _Errors(out):
  return [line for line in out.splitlines() if line.startswith('error:')]


def testTheCopyKeepsLingvosTablesScaledDown(flagship):
  del flagship
  train = experiment_params.GetParams(flagship_testlib.MODEL, 'Train')
  dev = experiment_params.GetParams(flagship_testlib.MODEL, 'Dev')
  test = experiment_params.GetParams(flagship_testlib.MODEL, 'Test')
  assert train.input.bucket_batch_limit == [4]
  assert train.input.fixed_input_shape
  assert dev.input.bucket_upper_bound == list(
      flagship_testlib.LINGVO_DEV_BOUNDS)
  assert dev.input.bucket_batch_limit == [8, 4, 2, 2, 1, 1, 1, 1, 1]
  assert dev.input.name == '1bwds_dev_set'
  assert test.input.name == '1bwds_test_set'
  assert 'heldout-00000' in test.input.file_pattern
  assert dev.task.eval.samples_per_summary == 0
  assert dev.task.cls.__name__ == 'BatchMajorLanguageModel'
  time_major = experiment_params.GetParams(
      flagship_testlib.TIME_MAJOR_MODEL, 'Train')
  assert time_major.task.cls.__name__ == 'FixedShapeInputLanguageModel'
  with open(train.input.tokenizer.token_vocab_filepath) as f:
    assert len(f.read().splitlines()) == flagship_testlib.VOCAB_SIZE


def testRecordsRefusalIsTheOneListOfScheduleRefusals():
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  assert records.Refusal('zbv', 4, 2, 4) is None
  assert records.Refusal('zbv', 1, 2, 4) is None  # One cell: ZB-H1's lists.
  assert 'at least twice the devices (4)' in records.Refusal('zbv', 2, 2, 4)
  assert 'an even number of cells' in records.Refusal('zbv', 3, 1, 4)
  assert records.Refusal('interleaved_1f1b', 4, 2, 4) is None
  assert 'num_micro_batches=3 must be a multiple' in records.Refusal(
      'interleaved_1f1b', 4, 2, 3)
  assert 'multiple of the number of devices' in records.Refusal(
      'interleaved_1f1b', 3, 2, 2)
  assert records.Refusal('recurrent', 2, 2, 2) is None
  error = records.Refusal('recurrent', 2, 2, 2, static_shapes=False)
  assert "use 'unrolled', '1f1b', 'interleaved_1f1b'" in error
  for name in records.NAMES:
    if name != 'recurrent':
      assert records.Refusal(name, 4, 2, 2, static_shapes=False) is None
  # The generators refuse exactly what the records do.
  from lingvo_ext.pipeline import kinds  # pylint: disable=g-import-not-at-top
  for name in records.ACTION_SCHEDULES:
    for k, dev, m in ((2, 2, 4), (3, 2, 2), (4, 2, 3), (4, 2, 4), (3, 1, 2)):
      spec = kinds.StageSpec(k, dev, m)
      try:
        records.Build(name, spec)
        built = True
      except ValueError:
        built = False
      assert built == (records.Refusal(name, k, dev, m) is None), (
          name, k, dev, m)


def testTheTrainersScheduleChecksNameTheFix(flagship):
  del flagship
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  model = flagship_testlib.MODEL

  def Refusal(overrides, devices=2, engine='lingvo_ext'):
    cfg = experiment_params.GetParams(model, 'Train', overrides,
                                      gpipe_engine=engine)
    return pipeline_tree.ScheduleRefusal(cfg, devices, engine)

  assert Refusal('') is None
  assert Refusal('task.lm.stack.schedule:"1f1b"') is None
  error = Refusal('task.lm.stack.schedule:"recurrent"')
  assert error.startswith('task.lm.stack: task 1bwds_wpm_level_lm '
                          '(BatchMajorLanguageModel) trims the time axis')
  assert "schedule='recurrent' needs every input dimension" in error
  error = Refusal('', engine='lingvo')
  assert error.startswith("--gpipe_engine=lingvo runs Lingvo's own loop")
  assert '--gpipe_engine=lingvo_ext' in error
  assert "2 cells on 2 devices" in Refusal('task.lm.stack.schedule:"zbv"')
  assert Refusal('task.lm.stack.schedule:"zbv"', devices=1) is None
  assert 'num_micro_batches=1 must be a multiple' in Refusal(
      'task.lm.stack.schedule:"interleaved_1f1b";'
      'task.lm.stack.num_micro_batches:1')
  assert Refusal('task.lm.stack.splits:8') == (
      'task.lm.stack: splits=8 leaves cells cell_4, cell_5, cell_6 without a '
      'layer (the stack has fewer layers than cells); set '
      'task.lm.stack.splits to at most 4.')
  # A static time axis (packed input): Lingvo's loop runs it.
  assert Refusal('task.lm.stack.schedule:"recurrent";task.packed_input:True'
                ) is None
  # lingvo_ext's own PipelinedTask: the same function.
  cfg = experiment_params.GetParams('lm.TransformerLmTinyGPipe', 'Train',
                                    'task.schedule:"zbv"')
  assert 'cells on 2 devices' in pipeline_tree.ScheduleRefusal(cfg, 2)


def testTheBuilderRefusesEmptyCellsAndADynamicTimeAxisInOneLine(flagship):
  del flagship
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  from tests.support import gpipe_testlib  # pylint: disable=g-import-not-at-top
  cfg = experiment_params.GetParams(flagship_testlib.MODEL, 'Train',
                                    'task.lm.stack.splits:8')
  with tf.Graph().as_default(), gpipe_testlib.Cluster(2):
    with pytest.raises(ValueError, match=r'cells cell_4, cell_5, cell_6 hold '
                       r'no layer \(8 cells'):
      cfg.task.lm.stack.Set(name='stack').Instantiate()
  cfg = experiment_params.GetParams(flagship_testlib.MODEL, 'Train',
                                    'task.lm.stack.schedule:"recurrent"')
  with tf.Graph().as_default(), gpipe_testlib.Cluster(2):
    stack = cfg.task.lm.stack.Set(name='stack').Instantiate()
    ids = tf.zeros([4, tf.random.uniform([], 2, 5, tf.int32)], tf.int32)
    with pytest.raises(ValueError) as e:
      stack.FPropDefaultTheta(ids, tf.zeros(tf.shape(ids), tf.float32))
  assert "schedule='recurrent' needs every input dimension known" in str(
      e.value) and '\n' not in str(e.value)


def _EvalMetrics(cfg, batches, devices, static=None):
  """The LM's eval metrics on each batch (numpy), fed with batch size
  `static` (None: each batch's own)."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from tests.support import gpipe_testlib  # pylint: disable=g-import-not-at-top
  length = cfg.input.target_max_length
  g = tf.Graph()
  with g.as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='evaler', cpus=devices, split_size=devices,
      do_eval=True):
    py_utils.GetOrCreateGlobalStepVar()
    task_p = cfg.task.Copy()
    task_p.input = cfg.input
    task = task_p.Instantiate()
    feeds = py_utils.NestedMap(
        ids=tf.placeholder(tf.int32, [static, length]),
        labels=tf.placeholder(tf.int32, [static, length]),
        paddings=tf.placeholder(tf.float32, [static, length]),
        word_count=tf.placeholder(tf.int32, [static]))
    batch = feeds.Transform(tf.identity)
    batch.weights = 1.0 - batch.paddings
    metrics, _ = task.FPropTower(task.theta, batch)
    variables = task.vars.Flatten()
  results = []
  with gpipe_testlib.Session(g, devices) as sess:
    gpipe_testlib.LoadSeededWeights(sess, variables)
    for b in batches:
      values = sess.run({k: v[0] for k, v in metrics.items()},
                        {feeds[k]: b[k] for k in feeds})
      results.append({k: float(v) for k, v in values.items()})
  return results


def _InputBatches(cfg, count):
  """`count` batches of the Dev input, as the evaler reads them."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    batch = cfg.input.Instantiate().GetPreprocessedInputBatch()
    fields = {k: batch[k] for k in ('ids', 'labels', 'paddings',
                                     'word_count')}
    with tf.Session() as sess:
      return [sess.run(fields) for _ in range(count)]


def testBucketedDevIsEvaluatedInEachBucketsBatchAsInSequence(flagship):
  del flagship
  cfg = experiment_params.GetParams(flagship_testlib.MODEL, 'Dev')
  static = max(cfg.input.bucket_batch_limit)
  padded = _InputBatches(cfg, 12)
  # Every batch has its stated shape; the rows past its bucket's batch are
  # padding (word_count -1, paddings 1).
  assert {b['ids'].shape for b in padded} == {(static, 48)}
  real = [{k: v[b['word_count'] >= 0] for k, v in b.items()} for b in padded]
  sizes = sorted({len(b['word_count']) for b in real})
  assert sizes == [1, 2, 4], sizes  # The scaled table's buckets in use.
  for b, r in zip(padded, real):
    assert (b['paddings'][len(r['ids']):] == 1).all()
  sequential = _EvalMetrics(cfg, real, devices=1)
  for schedule in ('unrolled', '1f1b'):
    cfg.task.lm.stack.schedule = schedule
    pipelined = _EvalMetrics(cfg, padded, devices=2, static=static)
    for seq, pipe, b in zip(sequential, pipelined, real):
      assert pipe.keys() == seq.keys()
      for k in seq:
        assert pipe[k] == pytest.approx(seq[k], rel=1e-5, abs=1e-6), (
            schedule, k, len(b['word_count']))
  # Every metric counts the batch's own rows only.
  assert [m['num_predictions'] for m in sequential] == [
      float(np.sum(1 - b['paddings'])) for b in real]
  assert [m['num_words'] for m in sequential] == [
      float(np.sum(b['word_count'] + 1)) for b in real]


_DEVICES = ['--num_cpu_devices=2', '--worker_split_size=2']


def _Metrics(out, job):
  """{name: value} of a job's metrics line."""
  lines = [l for l in out.splitlines() if l.startswith(f'{job}: step ')]
  assert len(lines) == 1, out[-3000:]
  fields = lines[0].split()[3:]
  return {k: float(v) for k, v in zip(fields[::2], fields[1::2])}


def _Refused(root, tmp_path, args, expected):
  """Runs the trainer with `args`: one error line starting `expected`,
  exit 2, and no logdir."""
  logdir = tmp_path / 'refused'
  rc, out = _Run(root, [f'--logdir={logdir}', *_DEVICES, *args])
  errors = _Errors(out)
  assert rc == 2 and len(errors) == 1, (args, out[-3000:])
  assert errors[0].startswith('error: ' + expected), (args, errors)
  assert not logdir.exists(), args
  return errors[0]


@pytest.mark.e2e
def testTheFlagshipInEveryJob(flagship, tmp_path):
  model = f'--model={flagship_testlib.MODEL}'
  logdir = tmp_path / 'logdir'
  rc, out = _Run(flagship, [model, f'--logdir={logdir}', *_DEVICES,
                            '--max_steps=2'])
  assert rc == 0 and 'step 2/2' in out, out[-3000:]
  # The evaler on Dev and Test: every bucket's batch (1, 2, 4 sentences),
  # each sentence counted once.
  for dataset in ('dev', 'test'):
    rc, out = _Run(flagship, [model, f'--logdir={logdir}', *_DEVICES,
                              f'--job=evaler_{dataset}', '--eval_once'])
    assert rc == 0, out[-3000:]
    metrics = _Metrics(out, f'evaler_{dataset}')
    assert metrics['total_samples'] == 40  # DEV_SAMPLES, TEST_SAMPLES
    assert 5 < metrics['log_pplx'] < 8  # log(256) = 5.5 for a uniform LM.
    assert metrics['num_predictions'] == metrics['num_words']
  # The decoder: Lingvo's LM has none; said up front.
  _Refused(flagship, tmp_path, [model, '--job=decoder_dev'],
           '--job=decoder_dev: task 1bwds_wpm_level_lm '
           '(BatchMajorLanguageModel) has no decoder')
  # A damaged newest checkpoint is no evaluation failure: the evaler says
  # so in one line and evaluates the one before (checkpoints.reader).
  broken = tmp_path / 'broken'
  shutil.copytree(logdir, broken)
  for path in (broken / 'train').glob('ckpt-00000002.data-*'):
    path.write_bytes(b'\0' * path.stat().st_size)
  rc, out = _Run(flagship, [model, f'--logdir={broken}', *_DEVICES,
                            '--job=evaler_dev', '--eval_once'])
  assert rc == 0, out[-3000:]
  assert not _Errors(out), out[-3000:]
  warnings = [l for l in out.splitlines() if l.startswith('warning: skipped')]
  assert len(warnings) == 1, out[-3000:]
  assert re.match(r'warning: skipped damaged checkpoint \S+/ckpt-00000002 '
                  r'\(.+\); using \S+/ckpt-\d{8}\.$', warnings[0]), warnings
  assert _Metrics(out, 'evaler_dev')['total_samples'] == 40


@pytest.mark.e2e
@pytest.mark.parametrize('schedule', ['1f1b', 'interleaved_1f1b',
                                      'zero_bubble'])
def testTheFlagshipTrainsUnderTheListSchedules(flagship, tmp_path, schedule):
  rc, out = _Run(flagship, [
      f'--model={flagship_testlib.MODEL}', f'--logdir={tmp_path / "l"}',
      *_DEVICES, '--max_steps=1',
      f'--model_params_override=task.lm.stack.schedule:"{schedule}"'])
  assert rc == 0 and 'step 1/1' in out, out[-3000:]
  assert not _Errors(out)


@pytest.mark.e2e
def testEveryBadInputIsOneLineBeforeAnythingIsWritten(flagship, tmp_path):
  model = f'--model={flagship_testlib.MODEL}'
  over = '--model_params_override='
  empty = tmp_path / 'empty.txt'
  empty.write_text('')
  cases = [
      ([model, over + 'input.tokenizer.token_vocab_filepath:"/no/vocab.txt"'],
       "the Train input (1bwds_train_set): input.tokenizer."
       "token_vocab_filepath='/no/vocab.txt': no such file"),
      ([model, over + 'input.tokenizer.vocab_size:300'],
       'the Train input (1bwds_train_set): input.tokenizer.'
       'token_vocab_filepath='),
      ([model, '--job=evaler_dev', over + f'input.file_pattern:"text:{empty}"'],
       'the Dev input (1bwds_dev_set): input.file_pattern='),
      ([model, '--job=evaler_test', over + 'input.file_pattern:"text:/no/x*"'],
       'the Test input (1bwds_test_set): input.file_pattern='),
      ([model, '--job=evaler_dev', '--eval_once'],
       '--eval_once: no checkpoint in '),
      ([model, over + 'task.lm.stack.schedule:"recurrent"'],
       'task.lm.stack: task 1bwds_wpm_level_lm (BatchMajorLanguageModel) '
       "trims the time axis to each batch; schedule='recurrent' needs"),
      ([model, '--gpipe_engine=lingvo'],
       "--gpipe_engine=lingvo runs Lingvo's own loop on task.lm.stack"),
      ([model, over + 'task.lm.stack.schedule:"zbv"'],
       "task.lm.stack: schedule='zbv': 2 cells on 2 devices"),
      ([model, over + 'task.lm.stack.schedule:"interleaved_1f1b";'
        'task.lm.stack.num_micro_batches:1'],
       "task.lm.stack: schedule='interleaved_1f1b': num_micro_batches=1"),
      ([model, over + 'task.lm.stack.splits:8'],
       'task.lm.stack: splits=8 leaves cells cell_4, cell_5, cell_6 '
       'without a layer'),
      ([f'--model={flagship_testlib.TIME_MAJOR_MODEL}'],
       'task 1bwds_wpm_level_lm (FixedShapeInputLanguageModel) feeds '
       'task.lm (GPipeTransformerLm) time-major ids'),
  ]
  for args, expected in cases:
    _Refused(flagship, tmp_path, args, expected)
  error = _Refused(flagship, tmp_path, cases[1][0], cases[1][1])
  assert error.endswith('has 256 entries but input.tokenizer.vocab_size=300; '
                        "set vocab_size (and the model's) to 256, or use a "
                        'vocab of 300.')
