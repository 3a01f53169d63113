"""Checkpoints across cuts: a checkpoint written under one cut or naming,
restored into a model built under another.

- `PlanRestore`, `CheckpointVarMap`: onto a built model, from the leaves
  `cuts.ModelLeaves` lists: any cut into cells, Lingvo's names or
  `partition_independent_names`, `cell_NNN` or the user's names, optimizer
  slots included;
- `Layout`, `RenameKeys`: a checkpoint's keys renamed between two cuts given
  only the two layouts, for models that are not registered.
"""

import collections
from typing import Dict
from typing import Iterable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import lingvo.compat as tf

from lingvo_ext.pipeline import cuts


def _AliasTables(leaves: Sequence[cuts.Leaf]) -> Dict[str, Dict[str, cuts.Leaf]]:
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
                leaves: Optional[Sequence[cuts.Leaf]] = None) -> RestorePlan:
  """Pairs a checkpoint's keys with a model's variables across cuts.

  A key the model has maps to itself; any other is translated through the
  leaves of `layer`'s pipelines (`cuts.ModelLeaves`). Keys with no counterpart are
  left out (e.g. optimizer slots the model lacks).

  Args:
    layer: The built model (or any layer holding the pipelines).
    checkpoint_keys: The checkpoint's variable names.
    model_keys: The model's variable names (checkpoint keys), slots included.
    required: The model keys that must be found (default: all).
    source: How messages name the checkpoint.
    leaves: The model's leaves, if known (default: cuts.ModelLeaves(layer)).

  Returns:
    A RestorePlan.

  Raises:
    ValueError: a required variable has no counterpart, or several keys map
      onto one variable (one line naming them).
  """
  model_keys = set(model_keys)
  if leaves is None:
    leaves = cuts.ModelLeaves(layer)
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
          'layers distinct names.' % (key, source, cuts.FewNames(sorted(found))))
    for target, (old, new) in found.items():
      by_target[target].append(key)
      if old != new:
        renamed[new] = old
  ambiguous = ['%s <- %s' % (t, ' / '.join(ks))
               for t, ks in sorted(by_target.items()) if len(ks) > 1]
  if ambiguous:
    raise ValueError(
        'Ambiguous restore from %s: several checkpoint keys map onto one '
        'variable: %s.' % (source, cuts.FewNames(ambiguous, 3)))
  required = model_keys if required is None else set(required)
  missing = sorted(required - set(by_target))
  if missing:
    raise ValueError(
        '%d variable(s) of the model have no counterpart in %s, under any '
        'cut or naming of the layers: %s.' % (len(missing), source,
                                              cuts.FewNames(missing)))
  keys = {ks[0]: t for t, ks in by_target.items()}
  order = {l.scope[:-1]: i for i, l in enumerate(leaves)}
  pairs = sorted(((old, new) for new, old in renamed.items()),
                 key=lambda p: order.get(p[1], len(order)))
  return RestorePlan(keys, pairs)


def _SlotsOf(variables, graph) -> list:
  """Global variables of `graph` named `<variable>/<slot>` (optimizer slots)."""
  names = {cuts.VariableKey(v) for v in variables}
  slots = []
  for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES):
    key = cuts.VariableKey(v)
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
    required = [cuts.VariableKey(v) for v in own]
    variables = own + _SlotsOf(own, graph)
  else:
    variables = list(variables)
    required = [cuts.VariableKey(v) for v in variables]
  by_key = {cuts.VariableKey(v): v for v in variables}
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
        cuts.GlobalName(i) for i in range(total)]
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
        'the naming of the checkpoint.' % cuts.FewNames(
            ['%r in %s' % (p, ks[0]) for p, ks in sorted(prefixes.items())],
            3))
  clash = [n for n, c in collections.Counter(out.values()).items() if c > 1]
  if clash:
    raise ValueError('Two checkpoint keys would both be named %s; check the '
                     'layouts.' % cuts.FewNames(sorted(clash)))
  return out
