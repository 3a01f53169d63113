"""Rewrites a checkpoint's variable names from one model to another.

Pipeline cells name their sub-layers' variables either as lingvo.core.gpipe
does, with the cell's scope (`lm/d1/cell_002/w/var`, the default of
`SeqLayer.partition_independent_names`), or without it (`lm/cell_002/w/var`,
lingvo_ext's experiments). A checkpoint therefore moves between the two
namings, and a Lingvo-named checkpoint between partitionings (K cells to K'),
only through a rename. This tool builds both models (their training graphs,
so optimizer slots are included), pairs every variable of the checkpoint
with the target model's by its name without cell scopes, checks shapes, and
writes the checkpoint under the target's names: variables, optimizer slots
(`.../var/Adam`) and the global step.

  .venv/bin/python -m lingvo_ext.tools.convert_checkpoint \\
      --from_model=lm.TransformerLmTinyGPipe \\
      --from_model_params_override='task.partition_independent_names:False' \\
      --from_checkpoint=/tmp/lm/train/ckpt-00000020 \\
      --to_num_partitions=4 --to_checkpoint=/tmp/lm4/train/ckpt-00000020

--to_model defaults to --from_model. --from_num_partitions/--to_num_partitions
and --from_names/--to_names (lingvo or partition_independent) are shortcuts
for the overrides `task.num_partitions` and `task.partition_independent_names`
of lingvo_ext's pipelined tasks; `--*_model_params_override` takes any
override, as the trainer's --model_params_override does ('a.b:v;c:w').
Leaves named `cell_NNN` and leaves keeping the user's names
(`task.keep_layer_names`) are paired too, by their index in the stack.

A model that is not registered (e.g. a stack cut by lingvo.core.gpipe's
PartitionSequentialLayers in one's own graph) is converted from the two
layouts alone: the leaves per cell of each cut, and the naming:

  .venv/bin/python -m lingvo_ext.tools.convert_checkpoint \\
      --from_checkpoint=/tmp/mine/ckpt --from_cut=3,4,4,5 \\
      --to_cut=4,4,4,4 --to_checkpoint=/tmp/mine4/ckpt

(--from_names/--to_names as above; --layer_names=a,b,... with
--from_keep_layer_names/--to_keep_layer_names when a side's leaves keep the
user's names.) In one's own program, `lingvo_ext.core.gpipe.CheckpointVarMap`
restores such a checkpoint directly, without converting it.
It exits non-zero with a message naming the variables when one has no
counterpart in the other model or their shapes differ. --from_checkpoint
may be a directory (LOGDIR/train): its newest intact checkpoint is read, a
damaged newer one named (lingvo_ext/checkpoints/reader.py); a damaged
prefix is refused (exit 2).
"""

import argparse
import os
import sys
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo_ext import entry_point  # pylint: disable=g-bad-import-order

# isort: split
import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe

from lingvo_ext import checkpoints
from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import cut_checkpoints
from lingvo_ext.pipeline import cuts

_NAMES = {'lingvo': False, 'partition_independent': True}
_CELL_CLASSES = (gpipe.FeatureExtractionLayer,
                 lingvo_gpipe.FeatureExtractionLayer)


class ConversionError(ValueError):
  """The checkpoint cannot be converted; the message says why."""


def ModelParams(model: str, override: str = ''):
  """Training params of registered `model`, with `override` ('a.b:v;...')."""
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  try:
    mp = experiment_params.GetParams(model, 'Train').Copy()
  except LookupError as e:
    raise ConversionError('Model %r is not registered (%s); see '
                          '`python -m lingvo_ext.tools.list_models`.' %
                          (model, e)) from e
  if override:
    mp.FromText(override.replace(';', '\n'))
  return mp


def _Key(v) -> str:
  name = v.name
  return name[:-2] if name.endswith(':0') else name


def _CellScopeRenames(layer, renames: Dict[str, str]) -> None:
  """Adds {prefix with cell scope: prefix without} for layer's subtree."""
  if isinstance(layer, (gpipe.SeqLayer, lingvo_gpipe.SeqLayer)):
    for cell_name, cell in internal_lingvo.SeqCells(layer):
      if not isinstance(cell, _CELL_CLASSES):
        continue  # e.g. SequentialLayer: its scope is part of every naming.
      for sub_name, sub in cell.children.items():
        for v in sub.vars.Flatten():
          key = _Key(v)
          part = '%s/%s/' % (cell_name, sub_name)
          if key.startswith(part):
            at = 0
          elif '/' + part in key:
            at = key.index('/' + part) + 1
          else:
            continue  # Scope already dropped (partition-independent names).
          kept = key[:at + len(part)]
          renames[kept] = key[:at] + sub_name + '/'
  for child in layer.children.values():
    for c in (child if isinstance(child, list) else [child]):
      if hasattr(c, 'children'):
        _CellScopeRenames(c, renames)


def _Canonical(key: str, renames: Dict[str, str]) -> str:
  best = ''
  for kept in renames:
    if key.startswith(kept) and len(kept) > len(best):
      best = kept
  return renames[best] + key[len(best):] if best else key


def ModelLayout(mp) -> Tuple[Dict[str, List[int]], Dict[str, str]]:
  """({checkpoint key: shape}, cell-scope renames) of a model's train graph."""
  return _ModelLayout(mp)[:2]


def _ModelLayout(mp):
  """ModelLayout and the model's pipeline leaves (cuts.ModelLeaves)."""
  with tf.Graph().as_default(), cluster_factory.Cluster(mp.cluster):
    model = mp.Instantiate()
    model.ConstructFPropBPropGraph()
    shapes = {_Key(v): v.shape.as_list() for v in tf.global_variables()}
    renames = {}
    _CellScopeRenames(model, renames)
    leaves = cuts.ModelLeaves(model)
  return shapes, renames, leaves


def _Few(names: Sequence[str], n: int = 5) -> str:
  names = sorted(names)
  more = ' and %d more' % (len(names) - n) if len(names) > n else ''
  return ', '.join(names[:n]) + more


def Plan(ckpt_shapes: Dict[str, List[int]], from_renames: Dict[str, str],
         to_shapes: Dict[str, List[int]],
         to_renames: Dict[str, str],
         pairs: Optional[Dict[str, str]] = None) -> Dict[str, str]:
  """{source key: target key}, or ConversionError naming what does not fit.

  Keys pair by their names without cell scopes, or as `pairs` says.
  """
  to_by_canonical = {}
  for key in to_shapes:
    to_by_canonical[_Canonical(key, to_renames)] = key
  plan, missing, mismatched = {}, [], []
  for key, shape in ckpt_shapes.items():
    if pairs is not None:
      target = pairs.get(key)
    else:
      target = to_by_canonical.get(_Canonical(key, from_renames))
    if target is None:
      missing.append(key)
    elif list(to_shapes[target]) != list(shape):
      mismatched.append('%s %s -> %s %s' %
                        (key, shape, target, to_shapes[target]))
    else:
      plan[key] = target
  unfilled = sorted(set(to_shapes) - set(plan.values()))
  errors = []
  if missing:
    errors.append('%d checkpoint variable(s) have no counterpart in the '
                  'target model: %s' % (len(missing), _Few(missing)))
  if unfilled:
    errors.append('%d target variable(s) have no counterpart in the '
                  'checkpoint: %s' % (len(unfilled), _Few(unfilled)))
  if mismatched:
    errors.append('%d variable(s) differ in shape: %s' %
                  (len(mismatched), _Few(mismatched)))
  if errors:
    raise ConversionError(
        'Cannot convert: ' + '; '.join(errors) + '. The two models must have '
        'the same layers and shapes (check --to_model and the overrides); '
        'only cell scopes and partitioning may differ.')
  return plan


def LeafPlan(ckpt_shapes: Dict[str, List[int]], to_shapes: Dict[str, List[int]],
             to_leaves) -> Dict[str, str]:
  """As Plan, pairing keys by pipeline leaf (cut_checkpoints.PlanRestore).

  That pairs `cell_NNN` with the user's layer names too, under any cut.
  """
  try:
    keys = cut_checkpoints.PlanRestore(None, ckpt_shapes, to_shapes, required=(),
                            leaves=to_leaves).keys
  except ValueError as e:
    raise ConversionError(str(e)) from e
  return Plan(ckpt_shapes, {}, to_shapes, {}, pairs=keys)


def WriteCheckpoint(reader, plan: Dict[str, str], path: str) -> None:
  """Writes reader's tensors under plan's names to checkpoint `path`."""
  dtypes = reader.get_variable_to_dtype_map()
  items = sorted(plan.items(), key=lambda kv: kv[1])
  dirname = os.path.dirname(os.path.abspath(path))
  tf.io.gfile.makedirs(dirname)
  with tf.Graph().as_default() as g:
    feeds = [tf.placeholder(dtypes[src], name='t%d' % i)
             for i, (src, _) in enumerate(items)]
    save = tf.raw_ops.SaveV2(
        prefix=path, tensor_names=[dst for _, dst in items],
        shape_and_slices=[''] * len(items), tensors=feeds)
    with tf.Session(graph=g) as sess:
      sess.run(save, {f: reader.get_tensor(src)
                      for f, (src, _) in zip(feeds, items)})
  # Named relatively (TF joins it with dirname): the directory can move.
  tf.compat.v1.train.update_checkpoint_state(dirname, os.path.basename(path))


def Convert(from_checkpoint: str, from_model: str, to_checkpoint: str,
            to_model: Optional[str] = None, from_override: str = '',
            to_override: str = '') -> Dict[str, str]:
  """Converts; returns the {source key: target key} plan."""
  reader = tf.train.load_checkpoint(from_checkpoint)
  ckpt_shapes = {
      k: s for k, s in reader.get_variable_to_shape_map().items()
      if not k.startswith('_CHECKPOINTABLE')
  }
  _, from_renames = ModelLayout(ModelParams(from_model, from_override))
  to_shapes, to_renames, to_leaves = _ModelLayout(
      ModelParams(to_model or from_model, to_override))
  try:
    plan = LeafPlan(ckpt_shapes, to_shapes, to_leaves)
  except ConversionError as by_leaf:
    # Cells that are not PartitionSequentialLayers': pair by cell scope.
    try:
      plan = Plan(ckpt_shapes, from_renames, to_shapes, to_renames)
    except ConversionError:
      raise by_leaf  # pylint: disable=raise-missing-from
  WriteCheckpoint(reader, plan, to_checkpoint)
  return plan


def ConvertLayouts(from_checkpoint: str, from_layout: cut_checkpoints.Layout,
                   to_checkpoint: str,
                   to_layout: cut_checkpoints.Layout) -> Dict[str, str]:
  """Converts between two layouts of a stack, no model needed; the plan."""
  reader = tf.train.load_checkpoint(from_checkpoint)
  keys = [k for k in reader.get_variable_to_shape_map()
          if not k.startswith('_CHECKPOINTABLE')]
  try:
    plan = cut_checkpoints.RenameKeys(keys, from_layout, to_layout)
  except ValueError as e:
    raise ConversionError(str(e)) from e
  if keys and all(k == v for k, v in plan.items()):
    raise ConversionError(
        'no key of %s has a leaf scope of --from_cut %s (e.g. %s); check '
        '--from_cut, --from_names and --from_keep_layer_names.' %
        (from_checkpoint, ','.join(map(str, from_layout.cut)),
         '%s/%s' % (from_layout.cell_names[0], from_layout.names[0])
         if not from_layout.independent else from_layout.names[0]))
  WriteCheckpoint(reader, plan, to_checkpoint)
  return plan


def _Override(override: str, num_partitions: Optional[int],
              names: Optional[str]) -> str:
  parts = [override] if override else []
  if num_partitions is not None:
    parts.append('task.num_partitions:%d' % num_partitions)
  if names is not None:
    parts.append('task.partition_independent_names:%s' % _NAMES[names])
  return ';'.join(parts)


def _ParseArgs(argv):
  parser = argparse.ArgumentParser(
      prog='python -m lingvo_ext.tools.convert_checkpoint',
      description=__doc__.splitlines()[0])
  parser.add_argument('--from_checkpoint', required=True,
                      help='Checkpoint prefix to read, e.g. '
                      'LOGDIR/train/ckpt-00000020, or a directory '
                      '(LOGDIR/train): its newest intact checkpoint.')
  parser.add_argument('--to_checkpoint', required=True,
                      help='Checkpoint prefix to write; a `checkpoint` '
                      'state file pointing at it is written beside it.')
  parser.add_argument('--from_model', default=None,
                      help='Registered model that wrote the checkpoint, '
                      'e.g. lm.TransformerLmTinyGPipe (or give --from_cut '
                      'and --to_cut).')
  parser.add_argument('--to_model', default=None,
                      help='Registered model to convert for (default: '
                      '--from_model).')
  for side in ('from', 'to'):
    parser.add_argument('--%s_model_params_override' % side, default='',
                        help='Params overrides of the %s model, '
                        "'a.b:value;c:value'." % side)
    parser.add_argument('--%s_num_partitions' % side, type=int, default=None,
                        help='Shortcut for the override '
                        'task.num_partitions of the %s model.' % side)
    parser.add_argument('--%s_names' % side, choices=sorted(_NAMES),
                        default=None,
                        help="Shortcut: 'lingvo' or 'partition_independent' "
                        'sets task.partition_independent_names of the %s '
                        'model; with --%s_cut, whether its keys have the '
                        'cell scope.' % (side, side))
    parser.add_argument('--%s_cut' % side, type=_Cut, default=None,
                        help='Without a registered model: the leaf layers '
                        'in each cell of the %s checkpoint, e.g. 3,4,4,5.' %
                        side)
    parser.add_argument('--%s_keep_layer_names' % side, action='store_true',
                        help='With --%s_cut: its leaves keep the names of '
                        '--layer_names (else cell_000, ...).' % side)
  parser.add_argument('--layer_names', type=_Names, default=None,
                      help='With --from_cut/--to_cut: the leaf layers\' '
                      'names in order, comma-separated.')
  args = parser.parse_args(argv)
  if (args.from_cut is None) != (args.to_cut is None):
    parser.error('give both --from_cut and --to_cut (or neither, with '
                 '--from_model).')
  if args.from_cut is None and not args.from_model:
    parser.error('give --from_model (a registered model) or --from_cut and '
                 '--to_cut (the two layouts).')
  if ((args.from_keep_layer_names or args.to_keep_layer_names) and
      not args.layer_names):
    parser.error('--from_keep_layer_names/--to_keep_layer_names need '
                 '--layer_names=a,b,...')
  return args


def _Cut(text):
  try:
    cut = [int(n) for n in text.split(',')]
  except ValueError:
    raise argparse.ArgumentTypeError(
        '%r: give the leaf layers per cell, e.g. 3,4,4,5' % text) from None
  if not cut or min(cut) < 0:
    raise argparse.ArgumentTypeError(
        '%r: give the leaf layers per cell, e.g. 3,4,4,5' % text)
  return cut


def _Names(text):
  return [n.strip() for n in text.split(',')]


def _LayoutOf(args, side):
  names = getattr(args, side + '_names')
  keep = getattr(args, side + '_keep_layer_names')
  return cut_checkpoints.Layout(getattr(args, side + '_cut'),
                     independent=names == 'partition_independent',
                     layer_names=args.layer_names if keep else None)


def _FromCheckpoint(path):
  """(the checkpoint prefix to read, or None; the error line, or None)."""
  if tf.io.gfile.isdir(path):
    found = checkpoints.NewestIntactCheckpoint(path)
    if not found:
      return None, (f'error: --from_checkpoint={path}: no intact checkpoint '
                    'in this directory; pass a checkpoint prefix such as '
                    f'{os.path.join(path, "ckpt-00000020")}.')
    return found, None
  if not tf.io.gfile.exists(path + '.index'):
    return path, None  # Reading it names what is missing.
  problem = checkpoints.ReadProblem(path)
  if problem:
    return None, (f'error: --from_checkpoint={path} is a damaged checkpoint '
                  f'({problem}); pass an intact one, or its directory '
                  f'({os.path.dirname(path)}) for the newest intact one.')
  return path, None


def main(argv=None) -> int:
  args = _ParseArgs(sys.argv[1:] if argv is None else argv)
  error = entry_point.ParseFlags()  # Lingvo's layers read some as they build.
  if error:
    print('convert_checkpoint: %s' % error, file=sys.stderr)
    return 2
  args.from_checkpoint, error = _FromCheckpoint(args.from_checkpoint)
  if error:
    print(error, file=sys.stderr)
    return 2
  try:
    if args.from_cut is not None:
      plan = ConvertLayouts(args.from_checkpoint, _LayoutOf(args, 'from'),
                            args.to_checkpoint, _LayoutOf(args, 'to'))
    else:
      plan = Convert(
          args.from_checkpoint, args.from_model, args.to_checkpoint,
          args.to_model,
          _Override(args.from_model_params_override, args.from_num_partitions,
                    args.from_names),
          _Override(args.to_model_params_override, args.to_num_partitions,
                    args.to_names))
  except (ConversionError, ValueError, tf.errors.NotFoundError) as e:
    print('convert_checkpoint: %s' % e, file=sys.stderr)
    return 1
  renamed = sum(1 for k, v in plan.items() if k != v)
  print('convert_checkpoint: wrote %d variables (%d renamed) to %s' %
        (len(plan), renamed, args.to_checkpoint))
  return 0


if __name__ == '__main__':
  sys.exit(main())
