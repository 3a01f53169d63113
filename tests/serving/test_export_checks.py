"""The export's checks and notes, in process (serving/export.py): a task
without Inference(), the op libraries a graph needs, the tokenizer's vocab.
The NMT experiment end to end: tests/tasks/test_mt_decoding.py."""

import os

import lingvo.compat as tf
from lingvo.core import base_input_generator
from lingvo.core import base_model
from lingvo.core import hyperparams
from lingvo.core import ops as lingvo_ops
from lingvo.core import tokenizers

from lingvo_ext.serving import export


class _NoInferenceTask(base_model.BaseTask):
  pass


class _ServedTask(base_model.BaseTask):

  def Inference(self):
    return {}


def _Cfg(task_cls):
  cfg = hyperparams.Params()
  cfg.Define('task', task_cls.Params(), '')
  return cfg


def testATaskWithoutInferenceIsNamedWithTheMethodToAdd():
  problem = export.NoInference(_Cfg(_NoInferenceTask))
  assert problem == (
      f'its task {__name__}._NoInferenceTask has no Inference(): add the '
      "method, returning Lingvo's {subgraph name: (fetches, feeds)} (e.g. "
      "{'default': ...}); see docs/serving.md")
  assert export.NoInference(_Cfg(_ServedTask)) is None


def testTheOpLibrariesAreTheOpsTensorFlowLacks():
  graph_def = tf.GraphDef()
  for name, op in (('a', 'MatMul'), ('b', 'BeamSearchStepV2'),
                   ('c', 'NoSuchOpAnywhere')):
    graph_def.node.add(name=name, op=op)
  graph_def.library.function.add().node_def.add(name='d', op='UnpackHyp')
  x_ops = os.path.join(os.path.dirname(lingvo_ops.__file__), 'x_ops.so')
  libraries = export.CustomOpLibraries(graph_def)
  assert libraries == {x_ops: ['BeamSearchStepV2', 'UnpackHyp'],
                       '': ['NoSuchOpAnywhere']}
  assert export.CustomOpLines(libraries) == [
      "the SavedModel holds ops TensorFlow lacks (NoSuchOpAnywhere): load "
      'their library (tf.load_op_library) before tf.saved_model.load.',
      f"the SavedModel needs the op library {x_ops} (Lingvo's, for "
      f'BeamSearchStepV2, UnpackHyp): call tf.load_op_library({x_ops!r}) '
      'before tf.saved_model.load (docs/serving.md).']
  assert export.CustomOpLibraries(tf.GraphDef()) == {}


def testTheTokenizersVocabIsAnAsset(tmp_path):
  vocab = tmp_path / 'wpm.voc'
  vocab.write_text('<unk>\t0\n')
  cfg = hyperparams.Params()
  cfg.Define('input', base_input_generator.BaseSequenceInputGenerator.Params(),
             '')
  cfg.input.tokenizer = tokenizers.VocabFileTokenizer.Params().Set(
      token_vocab_filepath=str(vocab))
  assert export.TokenizerAssets(cfg) == {'wpm.voc': '<unk>\t0\n'}
  cfg.input.tokenizer.token_vocab_filepath = None
  assert export.TokenizerAssets(cfg) == {}
