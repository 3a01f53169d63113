"""How a layer stack is cut into pipeline cells, and the names that follow.

`PartitionSequentialLayers` flattens a stack into leaf layers and gives leaf
i the global name `cell_%03d % i`, as Lingvo does (or keeps the user's name,
`keep_layer_names=True`), under the scope of the cell it lands in (`d0`,
`d1`, ...). The cut shows in every variable name (`lm/d1/cell_003/w/var`),
but a leaf's global name does not depend on it. This module:

- reproduces Lingvo's heuristic cut (`LingvoFlatten`, `LingvoCut`), for
  `PartitionSequentialLayers(..., cut='lingvo')`;
- records each leaf's global name and the user's name in its cell's params
  (`RecordLeaves`; read back by `CellLeaves`), so that messages name the
  user's layer, `block3 (cell_005)`, in either naming (`LayerLabels`,
  `NameLayers`);
- lists the leaves of a built model with the names a checkpoint may give
  them (`ModelLeaves`), which `cut_checkpoints` maps across cuts.
"""

import collections
import re
from typing import Dict
from typing import Iterable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo.core import builder_layers
from lingvo.core import gpipe as lingvo_gpipe

from lingvo_ext._internal import lingvo as internal_lingvo

CUTS = ('exact', 'lingvo')

# Params that PartitionSequentialLayers defines on each cell it returns,
# aligned with the cell's `sub`.
GLOBAL_NAMES = 'leaf_global_names'
USER_NAMES = 'leaf_user_names'

_GLOBAL_NAME = re.compile(r'^cell_\d+$')


def GlobalName(index: int) -> str:
  """Lingvo's name of leaf `index` of a flattened stack."""
  return 'cell_%03d' % index


def FewNames(names: Sequence[str], n: int = 4) -> str:
  """The first n names, and how many more, for messages."""
  names = list(names)
  more = ' and %d more' % (len(names) - n) if len(names) > n else ''
  return ', '.join(names[:n]) + more


# ---------------------------------------------------------------------------
# Lingvo's heuristic cut.


def LingvoFlatten(params) -> list:
  """The leaves lingvo.core.gpipe.PartitionSequentialLayers cuts, as copies.

  Lingvo expands a SequentialLayer (`repeat` times) and its own
  FeatureExtractionLayer, but takes a list's items as they are: a
  SequentialLayer inside a list stays one leaf.

  Args:
    params: A layer's params or a list of them.

  Returns:
    A list of leaf params (copies).
  """
  if isinstance(params, (list, tuple)):
    return [p.Copy() for p in params]
  if params.cls in (builder_layers.SequentialLayer,
                    lingvo_gpipe.FeatureExtractionLayer):
    # Lingvo reads `repeat`, which its FeatureExtractionLayer lacks (it
    # fails there); once is what such a layer means.
    repeat = params.repeat if 'repeat' in params else 1
    return [s for _ in range(repeat) for p in params.sub
            for s in LingvoFlatten(p)]
  return [params.Copy()]


def LingvoCut(subs: Sequence, num_partitions: int,
              *shapes) -> Tuple[List[int], list]:
  """The number of leaves in each cell of Lingvo's heuristic cut.

  lingvo.core.gpipe.PartitionSequentialLayers puts leaf i into cell
  min(int(c_i * K), K - 1), c_i being the cumulative fraction of forward
  FLOPs (FPropMeta) up to and including leaf i. The arithmetic here is
  Lingvo's, so the cells are the same; some may be empty.

  Args:
    subs: The leaf params, in order.
    num_partitions: The number of cells K.
    *shapes: tshape.Shapes of the first leaf's inputs.

  Returns:
    (K cell sizes (0 for an empty cell) summing to len(subs), each leaf's
    FLOPs).
  """
  total, histo, flops = 0, [], []
  for s in subs:
    meta = s.cls.FPropMeta(s, *shapes)
    flops.append(meta.flops)
    total += meta.flops
    histo.append(total)
    shapes = meta.out_shapes
  if not total:
    raise ValueError(
        "PartitionSequentialLayers(cut='lingvo'): the layers' FPropMeta "
        'FLOPs sum to 0, so Lingvo\'s cut divides by zero; use '
        "cut='exact'.")
  sizes = [0] * num_partitions
  for x in histo:
    sizes[min(int(float(x / total) * num_partitions), num_partitions - 1)] += 1
  return sizes, flops


# ---------------------------------------------------------------------------
# Leaf names.


def LeafNames(subs: Sequence, keep_layer_names: bool) -> Tuple[List[str],
                                                                List[str],
                                                                List[str]]:
  """(names to give the leaves, their global names, the user's names).

  With keep_layer_names a leaf keeps its name; a name used by several leaves
  (e.g. from a repeated SequentialLayer) gets its occurrence as a suffix
  (`layer_0`, `layer_1`, ...), and a leaf without a name is `cell_NNN`.

  Args:
    subs: The leaf params, in order.
    keep_layer_names: Whether leaves keep their names (else `cell_NNN`).

  Returns:
    Three lists aligned with `subs`.

  Raises:
    ValueError: the kept names still collide.
  """
  global_names = [GlobalName(i) for i in range(len(subs))]
  user = [s.name or g for s, g in zip(subs, global_names)]
  if not keep_layer_names:
    return global_names, global_names, user
  counts = collections.Counter(user)
  seen = collections.Counter()
  names = []
  for name in user:
    if counts[name] > 1:
      names.append('%s_%d' % (name, seen[name]))
      seen[name] += 1
    else:
      names.append(name)
  dup = sorted(n for n, c in collections.Counter(names).items() if c > 1)
  if dup:
    raise ValueError(
        'PartitionSequentialLayers(keep_layer_names=True): leaf names %s '
        'collide after numbering repeated names; rename those layers or '
        'pass keep_layer_names=False (names cell_000, ...).' % FewNames(dup))
  return names, global_names, user


def _SetOrDefine(p, name, value, doc):
  if name in p:
    p.Set(**{name: value})
  else:
    p.Define(name, value, doc)


def RecordLeaves(cell_p, global_names: List[str],
                 user_names: List[str]) -> None:
  """Records a cell's leaves' global and user names in its params."""
  _SetOrDefine(
      cell_p, GLOBAL_NAMES, list(global_names),
      "Set by PartitionSequentialLayers: each sub-layer's global name "
      "(cell_NNN, its index in the flattened stack), aligned with `sub`.")
  _SetOrDefine(
      cell_p, USER_NAMES, list(user_names),
      "Set by PartitionSequentialLayers: each sub-layer's name as the user "
      "gave it, aligned with `sub`.")


def CellLeaves(cell_p) -> List[Tuple[str, str, str]]:
  """[(sub-layer name, the user's name, global name)] of a cell's params.

  Without a record (cells not made by PartitionSequentialLayers), a name
  `cell_NNN` is taken as the global name and every name as the user's.
  """
  if 'sub' not in cell_p:
    return []
  prefix = cell_p.variable_name_prefix if 'variable_name_prefix' in cell_p \
      else ''
  names = [s.name for s in cell_p.sub or []]
  # A built cell's params hold the prefixed names.
  names = [n if n.startswith(prefix) else prefix + n for n in names]
  glob = getattr(cell_p, GLOBAL_NAMES, None) if GLOBAL_NAMES in cell_p else None
  user = getattr(cell_p, USER_NAMES, None) if USER_NAMES in cell_p else None
  if not glob or len(glob) != len(names):
    glob = [n if _GLOBAL_NAME.match(n) else '' for n in names]
  if not user or len(user) != len(names):
    user = names
  return [(n, u or n, g) for n, u, g in zip(names, user, glob)]


def LayerLabel(user_name: str, global_name: str) -> str:
  """How a message names a leaf: `block3 (cell_005)`, or `cell_005`."""
  if not global_name or user_name == global_name:
    return user_name or global_name
  return '%s (%s)' % (user_name, global_name)


# ---------------------------------------------------------------------------
# The leaves of a built model.

Leaf = collections.namedtuple(
    'Leaf', ['prefix', 'scope', 'aliases', 'label'])
Leaf.__doc__ = """A leaf layer of a built pipeline.

prefix: the variable-name prefix of the pipeline's cells ('lm/').
scope: the prefix of the leaf's variables ('lm/d1/cell_003/').
aliases: the names the leaf may have in a checkpoint (global, user's, own).
label: how messages name it, `block3 (cell_005)`.
"""


def VariableKey(v) -> str:
  """A variable's checkpoint key: its name without ':0'."""
  name = v.name
  return name[:-2] if name.endswith(':0') else name


# What makes a layer a pipeline's sequence of cells, or a cell, here: the
# params that Lingvo's gpipe.SeqLayer and FeatureExtractionLayer define and
# lingvo_ext's (core/gpipe.py, its subclasses) define alike. By params, not
# by class, so that this module does not import gpipe.py, which imports it.
_SEQ_PARAMS = ('before_tpl', 'cell_tpl')
_CELL_PARAMS = ('sub', 'num_act_inputs', 'num_act_outputs',
                'act_fetch_layers')


def _Defines(layer, names) -> bool:
  p = getattr(layer, 'params', None)
  return p is not None and all(n in p for n in names)


def _IsSeqLayer(layer) -> bool:
  return _Defines(layer, _SEQ_PARAMS)


def _IsCell(layer) -> bool:
  return _Defines(layer, _CELL_PARAMS)


def _Layers(layer) -> Iterable:
  if isinstance(layer, (list, tuple)):  # Several models.
    for l in layer:
      yield from _Layers(l)
    return
  yield layer
  for child in layer.children.values():
    for c in (child if isinstance(child, (list, tuple)) else [child]):
      if hasattr(c, 'children'):
        yield from _Layers(c)


def _ScopeOf(key: str, parts: Sequence[str]) -> Optional[str]:
  """The prefix of `key` up to and including the first of `parts` found."""
  for part in parts:
    if key.startswith(part):
      return part
    at = key.find('/' + part)
    if at >= 0:
      return key[:at + 1 + len(part)]
  return None


def ModelLeaves(layer) -> List[Leaf]:
  """The leaves (with variables) of every pipeline in `layer`'s tree.

  Args:
    layer: A built layer or model, or a list of them.
  """
  leaves = []
  for seq in _Layers(layer):
    if not _IsSeqLayer(seq):
      continue
    for cell_name, cell in internal_lingvo.SeqCells(seq):
      if not _IsCell(cell):
        continue
      for sub_name, user, glob in CellLeaves(cell.params):
        sub = cell.children.get(sub_name)
        variables = sub.vars.Flatten() if sub is not None else []
        if not variables:
          continue
        key = VariableKey(variables[0])
        scope = _ScopeOf(key, ['%s/%s/' % (cell_name, sub_name)])
        if scope:  # Lingvo's names: <prefix><cell>/<leaf>/.
          prefix = scope[:-len(cell_name) - len(sub_name) - 2]
        else:  # partition_independent_names: <prefix><leaf>/.
          scope = _ScopeOf(key, [sub_name + '/'])
          if scope is None:
            continue
          prefix = scope[:-len(sub_name) - 1]
        own = sub_name
        aliases = tuple(dict.fromkeys(a for a in (glob, user, own) if a))
        leaves.append(Leaf(prefix, scope, aliases, LayerLabel(user, glob)))
  return leaves


def LayerLabels(layer) -> Dict[str, str]:
  """{variable scope of each leaf: 'block3 (cell_005)'} of `layer`'s tree."""
  return {l.scope: l.label for l in ModelLeaves(layer)}


def _ScopeIn(labels: Dict[str, str], text: str) -> str:
  best = ''
  for scope in labels:
    if scope in text and len(scope) > len(best):
      best = scope
  return best


def LayerOf(labels: Dict[str, str], text: str) -> str:
  """The label of the leaf whose variable `text` names, or ''.

  Args:
    labels: From `LayerLabels`.
    text: A message naming a variable, e.g. 'variable lm/d1/cell_005/w/var'.
  """
  best = _ScopeIn(labels, text)
  return labels[best] if best else ''


def NameLayers(labels: Dict[str, str], text: str) -> str:
  """`text` with ` (layer block3 (cell_005))` after a leaf's variable name.

  Args:
    labels: From `LayerLabels`.
    text: A message naming variables, e.g. 'variable lm/d1/cell_005/w/var'.

  Returns:
    The message naming the user's layer of the first variable found.
  """
  best = _ScopeIn(labels, text)
  if not best:
    return text
  m = re.search(re.escape(best) + r'[\w./-]*', text)
  return text[:m.end()] + ' (layer %s)' % labels[best] + text[m.end():]
