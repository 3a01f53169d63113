"""Decoding and serving the GPipe NMT experiment (tests/support/mt_testlib.py).

One trained run (`trained`: 600 steps on 2 CPU devices, then the decoder
job once over Dev with --eval_one_pass) serves the tests of the decoder's
BLEU (above copying the source), the exact one pass (every dev sentence
scored once) and the export. Lingvo's MT task has no `Inference()`: the
export and --mode=write_inference_graph refuse it in one line (exit 2),
naming the method. With one (tests/support/mt_serving_testlib.py: beam
search on fed ids), the export says which op library the SavedModel needs
(Lingvo's x_ops.so), ships the word-piece vocabulary under assets/, and its
signature, loaded in a process without Lingvo, returns the decoder job's
hypotheses.
"""

import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.support import mt_serving_testlib
from tests.support import mt_testlib

TIMEOUT = 600

# Run in a process that imports TensorFlow only (the docs' recipe,
# docs/serving.md): argv = [x_ops.so, export dir, ids .npy, paddings .npy,
# output .npy].
_SERVE = '''
import sys

import numpy as np
import tensorflow as tf

tf.load_op_library(sys.argv[1])  # Lingvo's x_ops.so, as the export says.
model = tf.saved_model.load(sys.argv[2])
out = model.signatures['default'](
    src_ids=tf.constant(np.load(sys.argv[3])),
    src_paddings=tf.constant(np.load(sys.argv[4])))
np.save(sys.argv[5], out['topk_decoded'].numpy())
'''


def _Run(argv, env, cwd=None):
  proc = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
                        check=False)
  return proc.returncode, proc.stdout


def _Errors(out):
  return [l for l in out.splitlines() if l.startswith('error:')]


def _DataDir(exp):
  return os.path.join(exp, 'wmt14', 'wpm')


def _DevSources(exp):
  """The dev set's (source ids, paddings), batch-major, as written."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = os.path.join(_DataDir(exp), 'dev.tfrecords')
  ids, paddings = [], []
  for record in tf.compat.v1.io.tf_record_iterator(path):
    features = tf.train.Example.FromString(record).features.feature
    ids.append(list(features['source_id'].int64_list.value))
    paddings.append(list(features['source_padding'].float_list.value))
  width = mt_testlib.MAX_LENGTH
  ids = np.array([i + [0] * (width - len(i)) for i in ids], np.int32)
  paddings = np.array([p + [1.0] * (width - len(p)) for p in paddings],
                      np.float32)
  return ids, paddings


_FLAGS = ('--num_cpu_devices=2', '--worker_split_size=2')
_BATCHES_OF_6 = '--model_params_override=input.bucket_batch_limit:[6, 6]'
_STEPS = 600


@pytest.fixture(scope='module')
def trained(shared_once):
  """{exp, logdir, decoded: the decoder job's output, env}: MODEL trained
  _STEPS steps, the served experiment's module beside it.

  Built once for all test workers (conftest.py); tests only read it.
  """
  def Build(root):
    exp, logdir = os.path.join(root, 'exp'), os.path.join(root, 'log')
    mt_testlib.Write(exp)
    mt_serving_testlib.Write(exp)
    env = mt_testlib.Env(exp)
    trainer = [sys.executable, '-m', 'lingvo_ext.trainer',
               f'--model={mt_testlib.MODEL}', f'--logdir={logdir}', *_FLAGS]
    rc, out = _Run(trainer + [f'--max_steps={_STEPS}'], env)
    assert rc == 0, out[-3000:]
    # Batches of 6: each bucket's last batch partial (padded, not counted).
    rc, out = _Run(trainer + ['--job=decoder_dev', '--eval_once',
                              '--eval_one_pass', _BATCHES_OF_6], env)
    assert rc == 0, out[-3000:]
    return dict(exp=exp, logdir=logdir, decoded=out, env=env)

  return shared_once('mt_decoding_trained', Build)


def _DecoderOut(logdir):
  """[(source, hyp0)] of the decoder's output file, in its order."""
  out_dir = os.path.join(logdir, 'decoder_dev')
  outs = [n for n in os.listdir(out_dir) if n.startswith('decoder_out_')]
  assert len(outs) == 1, outs
  with open(os.path.join(out_dir, outs[0]), 'rb') as f:
    pairs = pickle.load(f)
  found = []
  for _, line in pairs:
    # MTBaseModel's line: 'src: S tgt: T ' then ' hypN: H scoreN: X' per hyp.
    m = re.fullmatch(r'src: (.*) tgt: (.*?)  hyp0: (.*?) score0: \S+'
                     r'(?: hyp\d+: .* score\d+: \S+)*', line)
    found.append((m.group(1), m.group(3)))
  return found


def _Metrics(out, job):
  line = [l for l in out.splitlines() if l.startswith(f'{job}: step ')][-1]
  words = line.split()[3:]
  return {k: float(v) for k, v in zip(words[::2], words[1::2])}


def _DevPairs():
  """The dev set's (source, reference) sentences, as the decoder unsegments
  them."""
  words, at, shards = mt_testlib.Words(), 0, 2  # As mt_testlib.Write.
  for _ in range(shards):
    _, at = mt_testlib.Pairs(mt_testlib.TRAIN_EXAMPLES // shards, at, words)
  dev, _ = mt_testlib.Pairs(mt_testlib.DEV_EXAMPLES, at, words)
  return [(' '.join(s), ' '.join(t)) for s, t in dev]


@pytest.mark.e2e
def testOnePassScoresEveryDevSentenceOnce(trained):
  assert _Metrics(trained['decoded'], 'decoder_dev')['total_samples'] == (
      mt_testlib.DEV_EXAMPLES)
  sources = sorted(src for src, _ in _DecoderOut(trained['logdir']))
  assert sources == sorted(src for src, _ in _DevPairs())
  assert 'note: decoder_dev: scored' not in trained['decoded']


@pytest.mark.e2e
def testTheDecodersBleuIsAboveCopyingTheSource(trained):
  from lingvo.core import metrics  # pylint: disable=g-import-not-at-top
  # The decoder's metric (MTBaseModel's) on word pieces, the source as the
  # hypothesis.
  copy = metrics.CorpusBleuMetric(separator_type='wpm')
  for src, ref in _DevPairs():
    pieces = [' '.join(mt_testlib.WPM_SPACE + w for w in text.split())
              for text in (ref, src)]
    copy.Update(*pieces)
  bleu = _Metrics(trained['decoded'], 'decoder_dev')['corpus_bleu']
  assert bleu > copy.value + 0.1, (bleu, copy.value)


@pytest.mark.e2e
def testTheNoteSaysWhenLingvoScoresOtherThanTheSet(lingvo_mt_run, tmp_path):
  env = mt_testlib.Env(lingvo_mt_run.pythonpath)
  logdir = lingvo_mt_run.Copy(str(tmp_path / 'log'))
  trainer = [sys.executable, '-m', 'lingvo_ext.trainer',
             f'--model={mt_testlib.MODEL}', f'--logdir={logdir}', *_FLAGS,
             '--job=evaler_dev']
  # Batches of 6: whole batches to samples_per_summary (40) make 42.
  rc, out = _Run(trainer + ['--eval_once', _BATCHES_OF_6], env)
  assert rc == 0, out[-3000:]
  assert [l for l in out.splitlines() if l.startswith('note: evaler_dev')] == [
      'note: evaler_dev: scored 42 examples; the dev input has 40 '
      '(input.num_samples). Lingvo scores whole batches until '
      'samples_per_summary, in the order it reads, so some examples may '
      'count twice and others not at all; --eval_once --eval_one_pass '
      'scores each once.'], out[-3000:]
  # One pass: each sentence once, the partial batches' padded rows not
  # counted.
  rc, out = _Run(trainer + ['--eval_once', '--eval_one_pass', _BATCHES_OF_6],
                 env)
  assert rc == 0, out[-3000:]
  assert _Metrics(out, 'evaler_dev')['total_samples'] == 40
  assert 'note: evaler_dev' not in out
  rc, out = _Run(trainer + ['--eval_one_pass'], env)
  assert (rc, _Errors(out)) == (2, [
      'error: --eval_one_pass reads the Dev/Test files once, for one '
      'checkpoint: add --eval_once (or --eval_checkpoint=PREFIX).']), out


@pytest.mark.e2e
def testMtWithoutInferenceIsRefusedInOneLine(lingvo_mt_run, tmp_path):
  env = mt_testlib.Env(lingvo_mt_run.pythonpath)
  model = f'--model={mt_testlib.MODEL}'
  want = (f'error: --model={mt_testlib.MODEL}: its task '
          f'{mt_testlib.MODULE}.GPipeTransformerModel has no Inference(): '
          "add the method, returning Lingvo's {subgraph name: (fetches, "
          "feeds)} (e.g. {'default': ...}); see docs/serving.md.")
  export_dir = tmp_path / 'export'
  rc, out = _Run([os.path.join(os.path.dirname(sys.executable),
                               'lingvo-ext-export'), model,
                  f'--logdir={lingvo_mt_run.logdir}',
                  f'--export_dir={export_dir}'], env)
  assert (rc, _Errors(out)) == (2, [want]), out[-3000:]
  assert 'Traceback' not in out and not export_dir.exists()
  logdir = lingvo_mt_run.Copy(str(tmp_path / 'log'))
  rc, out = _Run([sys.executable, '-m', 'lingvo_ext.trainer', model,
                  f'--logdir={logdir}', '--mode=write_inference_graph'], env)
  assert (rc, _Errors(out)) == (2, [want]), out[-3000:]
  assert 'Traceback' not in out
  assert not os.path.exists(os.path.join(logdir, 'inference_graphs'))


@pytest.mark.e2e
def testTheBeamSearchSignatureGivesTheDecodersHypotheses(trained, tmp_path):
  exp, logdir, env = trained['exp'], trained['logdir'], trained['env']
  export_dir = str(tmp_path / 'export')
  rc, out = _Run([os.path.join(os.path.dirname(sys.executable),
                               'lingvo-ext-export'),
                  f'--model={mt_serving_testlib.SERVED_MODEL}',
                  f'--logdir={logdir}', f'--export_dir={export_dir}'], env)
  assert rc == 0, out[-3000:]
  needs = re.search(r"^the SavedModel needs the op library (\S+/x_ops\.so) "
                    r"\(Lingvo's, for ([^)]*)\): call tf\.load_op_library\('"
                    r"\1'\) before tf\.saved_model\.load \(docs/serving\.md\)"
                    r'\.$', out, re.M)
  assert needs, out[-3000:]
  assert 'BeamSearchStepV2' in needs.group(2).split(', ')
  # The vocabulary the input tokenizes with, as an asset.
  with open(os.path.join(export_dir, 'assets', 'wpm-ende.voc')) as f, open(
      os.path.join(_DataDir(exp), 'wpm-ende.voc')) as g:
    assert f.read() == g.read()
  # The SavedModel, in a process without Lingvo, on every dev source.
  ids, paddings = _DevSources(exp)
  np.save(tmp_path / 'ids.npy', ids)
  np.save(tmp_path / 'paddings.npy', paddings)
  served = tmp_path / 'served.npy'
  rc, out = _Run([sys.executable, '-c', _SERVE, needs.group(1), export_dir,
                  str(tmp_path / 'ids.npy'), str(tmp_path / 'paddings.npy'),
                  str(served)], dict(os.environ), cwd=str(tmp_path))
  assert rc == 0, out[-3000:]
  hyps = np.load(served, allow_pickle=True)
  assert hyps.shape == (len(ids), 2)  # Each source's beam (BEAM = 2).
  from lingvo.core import metrics  # pylint: disable=g-import-not-at-top
  unsegment = metrics.CorpusBleuMetric(separator_type='wpm').unsegmenter
  served_by_src = dict(zip((src for src, _ in _DevPairs()),
                           (unsegment(h.decode()) for h in hyps[:, 0])))
  decoded = _DecoderOut(logdir)
  assert len(decoded) == len(ids)
  assert sum(bool(hyp) for _, hyp in decoded) > len(ids) // 2  # Not empty.
  for src, hyp in decoded:
    assert served_by_src[src] == hyp, (src, hyp, served_by_src[src])
