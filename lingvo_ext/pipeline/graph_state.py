"""State the engine keeps per TF graph, freed with the graph.

A registry keyed by graph (even a WeakKeyDictionary) whose values hold that
graph's tensors or closures over them keeps every graph alive: the values
reference their graph. Kept on the graph object itself, the state goes when
the graph does.
"""

from typing import Any
from typing import Callable

_ATTR = '_lingvo_ext_state'


def Get(graph, name: str, default: Callable[[], Any]) -> Any:
  """`graph`'s state `name`, created by `default()` on first use."""
  state = getattr(graph, _ATTR, None)
  if state is None:
    state = {}
    setattr(graph, _ATTR, state)
  if name not in state:
    state[name] = default()
  return state[name]


def Peek(graph, name: str, missing: Any = None) -> Any:
  """`graph`'s state `name` if made, else `missing` (makes nothing)."""
  return getattr(graph, _ATTR, {}).get(name, missing)
