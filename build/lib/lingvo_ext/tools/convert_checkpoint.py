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

  python -m lingvo_ext.tools.convert_checkpoint \\
      --from_model=lm.TransformerLmTinyGPipe \\
      --from_model_params_override='task.partition_independent_names:False' \\
      --from_checkpoint=/tmp/lm/train/ckpt-00000020 \\
      --to_num_partitions=4 --to_checkpoint=/tmp/lm4/train/ckpt-00000020

--to_model defaults to --from_model. --from_num_partitions/--to_num_partitions
and --from_names/--to_names (lingvo or partition_independent) are shortcuts
for the overrides `task.num_partitions` and `task.partition_independent_names`
of lingvo_ext's pipelined tasks; `--*_model_params_override` takes any
override, as the trainer's --model_params_override does ('a.b:v;c:w').
It exits non-zero with a message naming the variables when one has no
counterpart in the other model or their shapes differ.
"""

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import lingvo_ext  # pylint: disable=unused-import,g-bad-import-order
import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe

from lingvo_ext.core import gpipe

_NAMES = {'lingvo': False, 'partition_independent': True}
_CELL_CLASSES = (gpipe.FeatureExtractionLayer,
                 lingvo_gpipe.FeatureExtractionLayer)


class ConversionError(ValueError):
  """The checkpoint cannot be converted; the message says why."""


def ModelParams(model: str, override: str = ''):
  """Training params of registered `model`, with `override` ('a.b:v;...')."""
  from lingvo import model_registry  # pylint: disable=g-import-not-at-top
  try:
    import params  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    pass  # The model may be registered by other means.
  flags = tf.flags.FLAGS
  if not flags.is_parsed():
    flags.mark_as_parsed()
  try:
    mp = model_registry.GetParams(model, 'Train').Copy()
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
    for cell_name, cell in layer._cells:  # pylint: disable=protected-access
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
  with tf.Graph().as_default(), cluster_factory.Cluster(mp.cluster):
    model = mp.Instantiate()
    model.ConstructFPropBPropGraph()
    shapes = {_Key(v): v.shape.as_list() for v in tf.global_variables()}
    renames = {}
    _CellScopeRenames(model, renames)
  return shapes, renames


def _Few(names: Sequence[str], n: int = 5) -> str:
  names = sorted(names)
  more = ' and %d more' % (len(names) - n) if len(names) > n else ''
  return ', '.join(names[:n]) + more


def Plan(ckpt_shapes: Dict[str, List[int]], from_renames: Dict[str, str],
         to_shapes: Dict[str, List[int]],
         to_renames: Dict[str, str]) -> Dict[str, str]:
  """{source key: target key}, or ConversionError naming what does not fit."""
  to_by_canonical = {}
  for key in to_shapes:
    to_by_canonical[_Canonical(key, to_renames)] = key
  plan, missing, mismatched = {}, [], []
  for key, shape in ckpt_shapes.items():
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
  tf.compat.v1.train.update_checkpoint_state(dirname, os.path.abspath(path))


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
  to_shapes, to_renames = ModelLayout(
      ModelParams(to_model or from_model, to_override))
  plan = Plan(ckpt_shapes, from_renames, to_shapes, to_renames)
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
                      'LOGDIR/train/ckpt-00000020.')
  parser.add_argument('--to_checkpoint', required=True,
                      help='Checkpoint prefix to write; a `checkpoint` '
                      'state file pointing at it is written beside it.')
  parser.add_argument('--from_model', required=True,
                      help='Registered model that wrote the checkpoint, '
                      'e.g. lm.TransformerLmTinyGPipe.')
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
                        'model.' % side)
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = _ParseArgs(sys.argv[1:] if argv is None else argv)
  try:
    plan = Convert(
        args.from_checkpoint, args.from_model, args.to_checkpoint,
        args.to_model,
        _Override(args.from_model_params_override, args.from_num_partitions,
                  args.from_names),
        _Override(args.to_model_params_override, args.to_num_partitions,
                  args.to_names))
  except (ConversionError, tf.errors.NotFoundError) as e:
    print('convert_checkpoint: %s' % e, file=sys.stderr)
    return 1
  renamed = sum(1 for k, v in plan.items() if k != v)
  print('convert_checkpoint: wrote %d variables (%d renamed) to %s' %
        (len(plan), renamed, args.to_checkpoint))
  return 0


if __name__ == '__main__':
  sys.exit(main())
