"""Layer arguments as tuples and nested structures as flat lists.

The one copy of what the pipeline's modules do to FProp's arguments and
results: a layer returns a tensor, a tuple or a list, and the next layer
takes them as positional arguments (`ToTuple`); a cell's inputs and outputs
are nested structures whose tensors a schedule walks in order (`Flat`).
"""

from typing import Any
from typing import List
from typing import Tuple

import lingvo.compat as tf


def ToTuple(x) -> Tuple:
  """x as positional arguments: a tuple as is, a list as a tuple, else (x,)."""
  if isinstance(x, list):
    return tuple(x)
  return x if isinstance(x, tuple) else (x,)


def Flat(structure: Any) -> List:
  """The leaves of a nested structure in tf.nest's order (None kept)."""
  return tf.nest.flatten(structure)
