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
- maps a checkpoint written under one cut or naming onto a model built under
  another (`PlanRestore`, `CheckpointVarMap`): any cut into cells, Lingvo's
  names or `partition_independent_names`, `cell_NNN` or the user's names,
  optimizer slots included;
- renames a checkpoint's keys between two cuts given only the two layouts
  (`Layout`, `RenameKeys`), for models that are not registered.
"""

import collections
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import lingvo.compat as tf
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


def _Few(names: Sequence[str], n: int = 4) -> str:
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
        'pass keep_layer_names=False (names cell_000, ...).' % _Few(dup))
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


def _Key(v) -> str:
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
        key = _Key(variables[0])
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


# ---------------------------------------------------------------------------
# Checkpoints across cuts.


def _AliasTables(leaves: Sequence[Leaf]) -> Dict[str, Dict[str, Leaf]]:
  """{pipeline prefix: {alias: leaf}}, aliases shared by leaves left out."""
  tables = collections.defaultdict(dict)
  shared = collections.defaultdict(set)
  for leaf in leaves:
    table = tables[leaf.prefix]
    for a in leaf.aliases:
      if a in table and table[a] is not leaf:
        shared[leaf.prefix].add(a)
      table[a] = leaf
  for prefix, names in shared.items():
    for a in names:
      del tables[prefix][a]
  return tables


def _Translations(key: str, tables, model_keys) -> List[Tuple[str, str, str]]:
  """[(model key, checkpoint's leaf scope, model's leaf scope)] for `key`.

  A checkpoint key is `<prefix>[<cell>/]<leaf>/<rest>`, the leaf under any of
  its aliases; its counterpart is `<model leaf scope><rest>` if the model has
  that variable.
  """
  found = []
  for prefix, table in tables.items():
    if not key.startswith(prefix):
      continue
    parts = key[len(prefix):].split('/')
    for skip in (0, 1):  # Without and with a cell scope.
      if len(parts) < skip + 2 or parts[skip] not in table:
        continue
      leaf = table[parts[skip]]
      target = leaf.scope + '/'.join(parts[skip + 1:])
      if target in model_keys:
        old = prefix + '/'.join(parts[:skip + 1])
        found.append((target, old, leaf.scope[:-1]))
  return found


class RestorePlan:
  """What restoring a checkpoint into a model across cuts does.

  Attributes:
    keys: {checkpoint key: model variable key}.
    renamed: [(checkpoint's leaf scope, model's leaf scope)], in model order,
      for the leaves whose names differ.
  """

  def __init__(self, keys, renamed):
    self.keys = keys
    self.renamed = renamed

  @property
  def num_renamed(self) -> int:
    return sum(1 for k, v in self.keys.items() if k != v)

  def Describe(self, n: int = 3) -> str:
    """'d1/cell_003 -> d0/cell_003, ...' (the pipeline prefix left out)."""
    pairs = []
    for old, new in self.renamed:
      common = 0
      while (common < min(len(old), len(new)) and old[common] == new[common]):
        common += 1
      common = old.rfind('/', 0, common) + 1
      pairs.append('%s -> %s' % (old[common:], new[common:]))
    more = ', ... (%d leaves)' % len(pairs) if len(pairs) > n else ''
    return ', '.join(pairs[:n]) + more


def PlanRestore(layer, checkpoint_keys: Iterable[str],
                model_keys: Iterable[str],
                required: Optional[Iterable[str]] = None,
                source: str = 'the checkpoint',
                leaves: Optional[Sequence[Leaf]] = None) -> RestorePlan:
  """Pairs a checkpoint's keys with a model's variables across cuts.

  A key the model has maps to itself; any other is translated through the
  leaves of `layer`'s pipelines (`ModelLeaves`). Keys with no counterpart are
  left out (e.g. optimizer slots the model lacks).

  Args:
    layer: The built model (or any layer holding the pipelines).
    checkpoint_keys: The checkpoint's variable names.
    model_keys: The model's variable names (checkpoint keys), slots included.
    required: The model keys that must be found (default: all).
    source: How messages name the checkpoint.
    leaves: The model's leaves, if known (default: ModelLeaves(layer)).

  Returns:
    A RestorePlan.

  Raises:
    ValueError: a required variable has no counterpart, or several keys map
      onto one variable (one line naming them).
  """
  model_keys = set(model_keys)
  if leaves is None:
    leaves = ModelLeaves(layer)
  tables = _AliasTables(leaves)
  by_target = collections.defaultdict(list)
  renamed = {}
  for key in sorted(checkpoint_keys):
    if key in model_keys:
      by_target[key].append(key)
      continue
    found = {t: (old, new) for t, old, new in _Translations(
        key, tables, model_keys)}
    if len(found) > 1:
      raise ValueError(
          'Ambiguous checkpoint key %s in %s: it maps onto %s; give the '
          'layers distinct names.' % (key, source, _Few(sorted(found))))
    for target, (old, new) in found.items():
      by_target[target].append(key)
      if old != new:
        renamed[new] = old
  ambiguous = ['%s <- %s' % (t, ' / '.join(ks))
               for t, ks in sorted(by_target.items()) if len(ks) > 1]
  if ambiguous:
    raise ValueError(
        'Ambiguous restore from %s: several checkpoint keys map onto one '
        'variable: %s.' % (source, _Few(ambiguous, 3)))
  required = model_keys if required is None else set(required)
  missing = sorted(required - set(by_target))
  if missing:
    raise ValueError(
        '%d variable(s) of the model have no counterpart in %s, under any '
        'cut or naming of the layers: %s.' % (len(missing), source,
                                              _Few(missing)))
  keys = {ks[0]: t for t, ks in by_target.items()}
  order = {l.scope[:-1]: i for i, l in enumerate(leaves)}
  pairs = sorted(((old, new) for new, old in renamed.items()),
                 key=lambda p: order.get(p[1], len(order)))
  return RestorePlan(keys, pairs)


def _SlotsOf(variables, graph) -> list:
  """Global variables of `graph` named `<variable>/<slot>` (optimizer slots)."""
  names = {_Key(v) for v in variables}
  slots = []
  for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES):
    key = _Key(v)
    if key not in names and any(key.startswith(n + '/') for n in names):
      slots.append(v)
  return slots


def CheckpointVarMap(layer, checkpoint_path: str,
                     variables=None) -> Dict[str, 'tf.Variable']:
  """{checkpoint key: variable} restoring `layer` from any cut of its stack.

  For `tf.train.Saver(var_list=CheckpointVarMap(layer, path)).restore(sess,
  path)`: the checkpoint may come from another cut of the same layers into
  cells (e.g. lingvo.core.gpipe's heuristic one), Lingvo's names or
  partition_independent_names, `cell_NNN` or the user's layer names.

  Args:
    layer: The built layer (a PipeliningLayer, or a model holding pipelines).
    checkpoint_path: A checkpoint prefix, or a directory (its latest).
    variables: The variables to restore, all of which must be found, e.g.
      `tf.global_variables()` for the whole graph (the global step and
      optimizer slots included). Default: `layer`'s variables, plus their
      optimizer slots in the current graph where the checkpoint has them.

  Returns:
    A dict to pass as `tf.train.Saver(var_list=...)`.

  Raises:
    ValueError: a variable has no counterpart in the checkpoint, or the
      mapping is ambiguous (one line naming the variables).
  """
  path = checkpoint_path
  if tf.io.gfile.isdir(path):
    path = tf.train.latest_checkpoint(path)
    if not path:
      raise ValueError('checkpoint_path=%r is a directory without a '
                       'checkpoint.' % checkpoint_path)
  ckpt_keys = tf.train.load_checkpoint(path).get_variable_to_shape_map()
  if variables is None:
    own = layer.vars.Flatten()
    graph = own[0].graph if own else tf.get_default_graph()
    required = [_Key(v) for v in own]
    variables = own + _SlotsOf(own, graph)
  else:
    variables = list(variables)
    required = [_Key(v) for v in variables]
  by_key = {_Key(v): v for v in variables}
  plan = PlanRestore(layer, ckpt_keys, by_key, required=required, source=path)
  return {k: by_key[t] for k, t in plan.keys.items()}


# ---------------------------------------------------------------------------
# Checkpoint keys between two layouts, without a model.


class Layout:
  """How a stack's leaves are cut and named, for renaming checkpoint keys.

  Args:
    cut: Leaves per cell, e.g. [3, 4, 4, 5].
    independent: partition_independent_names (no cell scope).
    layer_names: The user's names of the leaves in order, when the keys use
      them (keep_layer_names=True); None for `cell_NNN`.
    cell_names: The cells' scopes (default 'd0', 'd1', ...).
  """

  def __init__(self, cut: Sequence[int], independent: bool = False,
               layer_names: Optional[Sequence[str]] = None,
               cell_names: Optional[Sequence[str]] = None):
    if not cut or any(int(n) < 0 for n in cut):
      raise ValueError('cut=%r: give the number of leaf layers of each cell, '
                       'e.g. 3,4,4,5.' % (list(cut),))
    self.cut = [int(n) for n in cut]
    self.independent = independent
    total = sum(self.cut)
    if layer_names is not None and len(layer_names) != total:
      raise ValueError('layer_names has %d names but the cut %s has %d '
                       'leaves.' % (len(layer_names), self.cut, total))
    self.names = list(layer_names) if layer_names is not None else [
        GlobalName(i) for i in range(total)]
    self.cell_names = list(cell_names or
                           ['d%d' % i for i in range(len(self.cut))])

  def Scopes(self) -> List[str]:
    """Each leaf's scope relative to the pipeline prefix ('d1/cell_003/')."""
    scopes, i = [], 0
    for cell, n in zip(self.cell_names, self.cut):
      for _ in range(n):
        name = self.names[i]
        scopes.append(name + '/' if self.independent else
                      '%s/%s/' % (cell, name))
        i += 1
    return scopes


def RenameKeys(keys: Iterable[str], from_layout: Layout,
               to_layout: Layout) -> Dict[str, str]:
  """{key: renamed key} moving a checkpoint from one layout to another.

  A key with a leaf's scope of `from_layout` (`.../d1/cell_003/...`, the
  first one found) takes that leaf's scope of `to_layout`; other keys (e.g.
  global_step) stay.

  Raises:
    ValueError: the layouts have different numbers of leaves, or two keys
      would get one name.
  """
  src, dst = from_layout.Scopes(), to_layout.Scopes()
  if len(src) != len(dst):
    raise ValueError('The two layouts have %d and %d leaf layers; they must '
                     'cut the same stack.' % (len(src), len(dst)))
  # Longest scope first, so 'd1/cell_01/' never matches inside another.
  order = sorted(range(len(src)), key=lambda i: -len(src[i]))
  out, prefixes = {}, collections.defaultdict(list)
  for key in keys:
    new = key
    for i in order:
      at = -1
      if key.startswith(src[i]):
        at = 0
      elif ('/' + src[i]) in key:
        at = key.index('/' + src[i]) + 1
      if at >= 0:
        new = key[:at] + dst[i] + key[at + len(src[i]):]
        prefixes[key[:at]].append(key)
        break
    out[key] = new
  if len(prefixes) > 1:
    # One pipeline: its leaves' scopes all follow one prefix.
    raise ValueError(
        'The leaf scopes of the from layout follow several prefixes (%s), '
        'so it is not how these keys were cut or named; check the cut and '
        'the naming of the checkpoint.' % _Few(
            ['%r in %s' % (p, ks[0]) for p, ks in sorted(prefixes.items())],
            3))
  clash = [n for n, c in collections.Counter(out.values()).items() if c > 1]
  if clash:
    raise ValueError('Two checkpoint keys would both be named %s; check the '
                     'layouts.' % _Few(sorted(clash)))
  return out
