"""`lingvo-ext-export`: a checkpoint to a SavedModel and Lingvo's graph.

  .venv/bin/lingvo-ext-export --model=lm.TransformerLmTinyGPipe \\
      --logdir=/tmp/lm --export_dir=/tmp/lm_export

writes, in --export_dir, a TF2 SavedModel (saved_model.pb, variables/,
assets/ with the vocabulary when the model has one), one serving signature
per inference subgraph of the task (`default`, also as `serving_default`,
and `generate` for the LMs), and `inference.pbtxt`, Lingvo's inference graph
for `lingvo.core.predictor.Predictor` with the same checkpoint. The model is
exported as its sequential model on one device (`inference.py`), whatever
cut, schedule and devices it trained with. Every bad flag is one `error:`
line and exit 2, before anything is written. See docs/serving.md.
"""

import argparse
import os
import re
import shutil
import sys
from typing import Optional

import lingvo.compat as tf
from lingvo.core import base_model
from lingvo.core import ops as lingvo_ops

from lingvo_ext import checkpoints
from lingvo_ext import registry
from lingvo_ext.serving import inference
from lingvo_ext.serving import saved_model

VOCAB_FILENAME = 'vocab.json'
INFERENCE_GRAPH = 'inference.pbtxt'


class ExportError(ValueError):
  """A bad flag or input; the message is the one `error:` line."""


def NewestCompleteCheckpoint(train_dir: str) -> Optional[str]:
  """The newest checkpoint in `train_dir` whose every tensor reads back.

  Each newer damaged one is named on stderr (checkpoints.reader).
  """
  return checkpoints.NewestIntactCheckpoint(train_dir)


def ResolveCheckpoint(logdir: str, checkpoint: str) -> str:
  """The checkpoint to export from --logdir or --checkpoint; or ExportError."""
  if bool(logdir) == bool(checkpoint):
    raise ExportError(
        'pass one of --logdir (its newest complete checkpoint) and '
        '--checkpoint (a prefix such as LOGDIR/train/ckpt-00000100).')
  if checkpoint:
    problem = checkpoints.CheckpointProblem(checkpoint)
    if problem:
      raise ExportError(f'--checkpoint={checkpoint}: {problem}; pass a '
                        'checkpoint prefix such as LOGDIR/train/ckpt-00000100.')
    return checkpoint
  train_dir = os.path.join(logdir, 'train')
  path = NewestCompleteCheckpoint(train_dir)
  if path is None:
    raise ExportError(
        f'--logdir={logdir}: no complete checkpoint in {train_dir}; train '
        'the model into this logdir first, or pass --checkpoint.')
  return path


def CheckExportDir(export_dir: str, overwrite: bool) -> None:
  if not export_dir:
    raise ExportError('--export_dir is required, e.g. '
                      '--export_dir=/tmp/lingvo_ext/lm_export.')
  if os.path.exists(export_dir) and not overwrite:
    raise ExportError(f'--export_dir={export_dir} exists; pass another '
                      'directory, or --overwrite to replace it.')
  if os.path.exists(export_dir) and not os.path.isdir(export_dir):
    raise ExportError(f'--export_dir={export_dir} is a file; pass a '
                      'directory.')


def CheckSubgraphs(selected, available):
  """The subgraphs to export; ExportError names an unknown one."""
  if not selected:
    return sorted(available)
  unknown = [s for s in selected if s not in available]
  if unknown:
    raise ExportError(
        f'--subgraphs: no subgraph {unknown[0]!r} in this model; its '
        f'subgraphs are {", ".join(sorted(available))}.')
  return list(selected)


def CheckVariables(graph_def, checkpoint, model):
  """ExportError naming the first variables `checkpoint` lacks."""
  missing = saved_model.MissingVariables(graph_def, checkpoint)
  if missing:
    more = f' and {len(missing) - 3} more' if len(missing) > 3 else ''
    raise ExportError(
        f'{checkpoint} is not a checkpoint of --model={model}: it lacks '
        f'{", ".join(missing[:3])}{more}; pass the model it was trained '
        'with (and its --model_params_override).')


def _Assets(checkpoint):
  """{file name: text} of the vocabulary saved beside the checkpoint."""
  path = os.path.join(os.path.dirname(checkpoint), VOCAB_FILENAME)
  if not tf.io.gfile.exists(path):
    return {}
  with tf.io.gfile.GFile(path) as f:
    return {VOCAB_FILENAME: f.read()}


# Params of Lingvo's tokenizers that name a vocabulary file.
_VOCAB_PARAMS = ('token_vocab_filepath', 'ngram_vocab_filepath',
                 'vocab_filepath')


def TokenizerAssets(cfg):
  """{file name: text} of the vocabularies of the input's tokenizers
  (Lingvo's `tokenizer` and `tokenizer_dict`, e.g. NmtInput's word-piece
  vocab), each under its file's name."""
  inp = cfg.input if 'input' in cfg else None
  if inp is None:
    return {}
  tokenizers = [inp.tokenizer] if 'tokenizer' in inp else []
  if 'tokenizer_dict' in inp:
    tokenizers += list((inp.tokenizer_dict or {}).values())
  assets = {}
  for tok in tokenizers:
    for name in _VOCAB_PARAMS:
      path = tok.Get(name) if tok is not None and name in tok else None
      if path and tf.io.gfile.exists(path):
        with tf.io.gfile.GFile(path) as f:
          assets[os.path.basename(path)] = f.read()
  return assets


def NoInference(cfg):
  """Why `cfg`'s task cannot export (it has no `Inference()`), or None."""
  task = cfg.task if 'task' in cfg else None
  if task is None or task.cls.Inference is not base_model.BaseTask.Inference:
    return None
  return (f'its task {task.cls.__module__}.{task.cls.__name__} has no '
          "Inference(): add the method, returning Lingvo's {subgraph name: "
          "(fetches, feeds)} (e.g. {'default': ...}); see docs/serving.md")


def _CheckInference(cfg, model):
  problem = NoInference(cfg)
  if problem:
    raise ExportError(f'--model={model}: {problem}.')


def _SnakeCase(name):
  return re.sub(r'(?<!^)(?=[A-Z])', '_', name).lower()


def CustomOpLibraries(graph_def):
  """{op library path: [its op types]} the graph needs beyond TensorFlow's.

  An op type TensorFlow itself lacks (not in tf.raw_ops) comes from a
  library loaded with tf.load_op_library: Lingvo's x_ops.so (its beam
  search, vocab ops) or, under '', one this export cannot name.
  """
  types = {node.op for node in graph_def.node}
  for f in graph_def.library.function:
    types.update(node.op for node in f.node_def)
  x_ops = os.path.join(os.path.dirname(lingvo_ops.__file__), 'x_ops.so')
  found = {}
  for op in sorted(types):
    if hasattr(tf.raw_ops, op):
      continue
    known = hasattr(lingvo_ops.gen_x_ops, _SnakeCase(op))
    found.setdefault(x_ops if known else '', []).append(op)
  return found


def CustomOpLines(libraries):
  """What the export prints about the op libraries its SavedModel needs."""
  lines = []
  for path, op_types in sorted(libraries.items()):
    if path:
      lines.append(
          f'the SavedModel needs the op library {path} (Lingvo\'s, for '
          f'{", ".join(op_types)}): call tf.load_op_library({path!r}) '
          'before tf.saved_model.load (docs/serving.md).')
    else:
      lines.append(
          f'the SavedModel holds ops TensorFlow lacks ({", ".join(op_types)})'
          ': load their library (tf.load_op_library) before '
          'tf.saved_model.load.')
  return lines


def Export(model, export_dir, logdir='', checkpoint='', overwrite=False,
           subgraphs=(), overrides='', gpipe_engine='lingvo_ext', notes=None):
  """Checks everything, then writes the SavedModel and inference graph.

  Args:
    notes: A list to append the lines to print about the SavedModel to (the
      op libraries it needs to load), or None.

  Returns:
    (the checkpoint exported, the subgraph names written).

  Raises:
    ExportError: bad input; nothing was written.
  """
  error = registry.CheckModel(model) if model else (
      '--model is required, e.g. --model=lm.TransformerLmTinyGPipe.')
  if error:
    raise ExportError(error)
  CheckExportDir(export_dir, overwrite)
  checkpoint = ResolveCheckpoint(logdir, checkpoint)
  assets = _Assets(checkpoint)
  vocab_file = (os.path.join(os.path.dirname(checkpoint), VOCAB_FILENAME)
                if assets else '')
  try:
    cfg = inference.InferenceParams(model, overrides, gpipe_engine,
                                    vocab_file)
    _CheckInference(cfg, model)
    assets.update(TokenizerAssets(cfg))
    proto = saved_model.InferenceGraph(cfg)
  except NotImplementedError as e:  # An Inference() that raises it.
    raise ExportError(f'--model={model}: {NoInference(cfg) or e}.') from e
  except (LookupError, AttributeError) as e:
    raise ExportError(f'--model={model}: {e}') from e
  names = CheckSubgraphs(subgraphs, proto.subgraphs)
  CheckVariables(proto.graph_def, checkpoint, model)
  for name in list(proto.subgraphs):
    if name not in names:
      del proto.subgraphs[name]
  frozen = saved_model.Freeze(proto, checkpoint)
  libraries = CustomOpLibraries(frozen.graph_def)
  staging = f'{export_dir.rstrip("/")}.tmp{os.getpid()}'
  if os.path.exists(staging):
    shutil.rmtree(staging)
  try:
    saved_model.WriteSavedModel(frozen, staging, assets)
    with tf.io.gfile.GFile(os.path.join(staging, INFERENCE_GRAPH), 'w') as f:
      f.write(str(proto))
    if os.path.exists(export_dir):
      shutil.rmtree(export_dir)
    os.rename(staging, export_dir)
  finally:
    if os.path.exists(staging):
      shutil.rmtree(staging)
  if notes is not None:
    notes.extend(CustomOpLines(libraries))
  return checkpoint, names


def WriteInferenceGraph(model, logdir, overrides='', gpipe_engine='lingvo_ext'):
  """--mode=write_inference_graph: <logdir>/inference_graphs/inference.pbtxt.

  Returns:
    The lines to print.
  """
  vocab = os.path.join(logdir, 'train', VOCAB_FILENAME)
  cfg = inference.InferenceParams(
      model, overrides, gpipe_engine,
      vocab if tf.io.gfile.exists(vocab) else '')
  problem = NoInference(cfg)
  if problem:
    raise ValueError(problem + '.')
  out_dir = os.path.join(logdir, 'inference_graphs')
  path = os.path.join(out_dir, INFERENCE_GRAPH)
  tf.io.gfile.makedirs(out_dir)
  proto = saved_model.InferenceGraph(cfg, export_path=path)
  return [
      f'wrote {path} (subgraphs: {", ".join(sorted(proto.subgraphs))})',
      'skipped the TPU inference graph (inference_tpu.pbtxt): lingvo_ext '
      'does not target TPUs.'
  ]


class _ArgumentError(Exception):
  pass


class _Parser(argparse.ArgumentParser):
  """Raises on a bad flag, for the one `error:` line (argparse exits)."""

  def error(self, message):
    raise _ArgumentError(message)


def _MakeParser():
  parser = _Parser(
      prog='lingvo-ext-export', description=__doc__.split('\n')[0])
  parser.add_argument('--model', default='',
                      help='The registered experiment, e.g. '
                      'lm.TransformerLmTinyGPipe.')
  parser.add_argument('--logdir', default='',
                      help='Export its newest complete checkpoint '
                      '(<logdir>/train/ckpt-*).')
  parser.add_argument('--checkpoint', default='',
                      help='Export this checkpoint prefix instead.')
  parser.add_argument('--export_dir', default='',
                      help='Where to write; must not exist (see --overwrite).')
  parser.add_argument('--overwrite', action='store_true',
                      help='Replace an existing --export_dir.')
  parser.add_argument('--subgraphs', default='',
                      help='Comma-separated subgraphs to export, e.g. '
                      'default; empty: all of the task\'s.')
  parser.add_argument('--model_params_override', default='',
                      help="The trainer's overrides the model trained with.")
  return parser


def main(argv=None):
  """The console script; returns the exit code."""
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = _MakeParser()
  try:
    args = parser.parse_args(argv)
  except _ArgumentError as e:
    print(f'error: {e} (--help lists the flags)', file=sys.stderr)
    return 2
  # Lingvo's flags, which its layers and exporter read (the program's start).
  from lingvo_ext import entry_point  # pylint: disable=g-import-not-at-top
  error = entry_point.ParseFlags()
  if error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  subgraphs = [s for s in args.subgraphs.split(',') if s]
  try:
    op_lines = []
    checkpoint, names = Export(
        args.model, args.export_dir, args.logdir, args.checkpoint,
        args.overwrite, subgraphs, args.model_params_override,
        notes=op_lines)
  except ExportError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except ValueError as e:  # Bad params, found while building the model.
    print(f'error: --model={args.model}: {str(e).splitlines()[0]}',
          file=sys.stderr)
    return 2
  print(f'exported {checkpoint} to {args.export_dir}: SavedModel signatures '
        f'{", ".join(names)} (default also as serving_default), and '
        f'{INFERENCE_GRAPH} for Lingvo\'s Predictor.')
  for line in op_lines:
    print(line)
  return 0
