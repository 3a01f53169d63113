"""The optimizer state of the replicas' copies: recording and pairing it.

Replica r >= 1 (strategies that copy variables) makes its own optimizer
slots and accumulators; after a start it takes replica 0's restored ones.
These helpers record the variables an update creates and pair replica r's
with replica 0's.
"""

import contextlib
import re

import lingvo.compat as tf


def PairOptimizerVariables(r, mine, masters):
  """Pairs replica r's optimizer variables with replica 0's.

  Slots are matched by name (replica r's are named after its copies,
  'replica_r/<name>/...'). The rest (e.g. Adam's beta1_power, beta2_power)
  by their own name, less the scopes and the '_N' TensorFlow adds to a
  repeated name, and shape; only where that is ambiguous, in creation order
  among those of the same shape.
  """
  by_name = {v.op.name: v for v in masters}
  pairs, rest = [], []
  used = set()
  prefix = f'replica_{r}/'
  for v in mine:
    name = v.op.name
    if name.startswith(prefix) and name[len(prefix):] in by_name:
      theirs = by_name[name[len(prefix):]]
      pairs.append((v, theirs))
      used.add(id(theirs))
    else:
      rest.append(v)
  others = [v for v in masters if id(v) not in used]
  for v in rest:
    same = [m for m in others if m.shape == v.shape]
    named = [m for m in same if _BaseName(m) == _BaseName(v)]
    match = named[0] if len(named) == 1 else next(iter(same), None)
    if match is None:
      raise ValueError(
          f'replica {r}\'s optimizer variable {v.name} has no counterpart '
          f'among replica 0\'s {[m.name for m in masters]}.')
    others.remove(match)
    pairs.append((v, match))
  return pairs


def _BaseName(v):
  """'beta1_power' of '.../beta1_power_1': the name a variable was given."""
  return re.sub(r'_\d+$', '', v.op.name.rsplit('/', 1)[-1])


@contextlib.contextmanager
def NoSummaryInApply(opt):
  """The optimizer `opt` makes no summary in its Apply inside."""
  p = opt.params
  saved = p.add_summary_in_apply
  p.add_summary_in_apply = False
  try:
    yield
  finally:
    p.add_summary_in_apply = saved


def PathOfMirror(mirrors, var):
  """The path of `var` among {(replica, path): local variable} `mirrors`."""
  for (_, path), m in mirrors.items():
    if m is var:
      return path
  raise KeyError(var.name)


class RecordNewVariables:
  """Records the variables created inside; `local` makes them local ones."""

  def __init__(self, into, local):
    self._into = into
    self._local = local
    self._scope = None

  def _Creator(self, next_creator, **kwargs):
    if self._local:
      kwargs['collections'] = [tf.GraphKeys.LOCAL_VARIABLES]
    v = next_creator(**kwargs)
    self._into.append(v)
    return v

  def __enter__(self):
    self._scope = tf.variable_creator_scope(self._Creator)
    self._scope.__enter__()

  def __exit__(self, *args):
    return self._scope.__exit__(*args)
