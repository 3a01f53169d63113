"""The import graph of lingvo_ext/, read from the source (ast).

Nodes are files; an edge A -> B says A imports B (at module level or inside a
function: both tie the files together). `Cycles` lists the strongly connected
groups of files; `Violations` the imports that run from a lower floor of the
house to a higher one (`FLOORS`, docs/architecture.md).

  .venv/bin/python -m tests.import_graph      # the floors, cycles, violations
"""

import ast
import collections
import os
import sys
from typing import Dict
from typing import List
from typing import Set
from typing import Tuple

from tests.support import ROOT

PACKAGES = ('lingvo_ext', 'params')

# The floors of the house, bottom up, drawn from the folders: an entry is a
# folder or a module right under lingvo_ext/ (or another package of PACKAGES,
# whole), and every file lies in exactly one entry, whose floor is its floor.
# A file imports files of its own floor or of a floor below, never above.
# Every entry on disk is on one floor (`Unplaced`): a new folder needs a line.
FLOORS = (
    ('lingvo_ext/__init__.py', 'lingvo_ext/_startup.py',
     'lingvo_ext/entry_point.py', 'lingvo_ext/xla_cache.py',
     'lingvo_ext/cache_files.py', 'lingvo_ext/session_config.py',
     'lingvo_ext/devices.py', 'lingvo_ext/child_peak.py',
     'lingvo_ext/_internal/'),
    ('lingvo_ext/layers/',),
    ('lingvo_ext/pipeline/',),
    ('lingvo_ext/core/',),
    ('lingvo_ext/distributed/',),
    ('lingvo_ext/registry.py',),
    ('lingvo_ext/tasks/', 'lingvo_ext/checkpoints/'),
    ('params/',),
    ('lingvo_ext/tracing/', 'lingvo_ext/planner/', 'lingvo_ext/serving/'),
    ('lingvo_ext/preflight/',),
    ('lingvo_ext/runtime/',),
    ('lingvo_ext/trainer.py', 'lingvo_ext/launch.py', 'lingvo_ext/tools/',
     'lingvo_ext/examples/'),
)


def Files() -> List[str]:
  out = []
  for pkg in PACKAGES:
    for d, _, names in os.walk(os.path.join(ROOT, pkg)):
      out += [os.path.relpath(os.path.join(d, n), ROOT).replace(os.sep, '/')
              for n in names if n.endswith('.py')]
  return sorted(out)


def _ModuleFile(module: str, files: Set[str]):
  path = module.replace('.', '/')
  for f in (path + '.py', path + '/__init__.py'):
    if f in files:
      return f
  return None


def Edges() -> Dict[str, Set[str]]:
  """{file: the files of lingvo_ext/ it imports}."""
  files = Files()
  known = set(files)
  out = {}
  for f in files:
    tree = ast.parse(open(os.path.join(ROOT, f)).read(), f)
    deps = set()
    for node in ast.walk(tree):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        # `from a.b import c`: c is a module of a.b or a name in a.b.
        names = [node.module + '.' + a.name for a in node.names]
        names = [n if _ModuleFile(n, known) else node.module for n in names]
      for n in names:
        target = _ModuleFile(n, known)
        if target and target != f:
          deps.add(target)
    out[f] = deps
  return out


def Entry(f: str) -> str:
  """The folder or module right under its package that file `f` lies in
  (`lingvo_ext/core/`, `lingvo_ext/trainer.py`); another package whole."""
  parts = f.split('/')
  if parts[0] != PACKAGES[0]:
    return parts[0] + '/'
  if len(parts) == 2:
    return f
  return '/'.join(parts[:2]) + '/'


def Floor(f: str) -> int:
  entry = Entry(f)
  for i, entries in enumerate(FLOORS):
    if entry in entries:
      return i
  raise ValueError(f'{f} is on no floor: add {entry} to FLOORS.')


def Unplaced(files: List[str]) -> List[str]:
  """What FLOORS gets wrong: an entry of `files` on no floor, an entry on
  two floors or twice, an entry that is not a folder or module right under
  its package, or one that no file lies in."""
  listed = [e for entries in FLOORS for e in entries]
  on_disk = {Entry(f) for f in files}
  out = sorted(e + ': on no floor' for e in on_disk - set(listed))
  out += sorted({e + ': listed twice' for e in listed
                 if listed.count(e) > 1})
  out += sorted(e + ': not a folder or module right under its package'
                for e in listed if Entry(e + ('x.py' if e.endswith('/')
                                              else '')) != e)
  out += sorted(e + ': no file lies there' for e in set(listed) - on_disk
                if Entry(e + ('x.py' if e.endswith('/') else '')) == e)
  return out


def Cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
  """The groups of files that import each other, round and round (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def Visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        Visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        out.append(sorted(group))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
  for v in sorted(edges):
    if v not in index:
      Visit(v)
  return out


def Violations(edges: Dict[str, Set[str]]) -> List[Tuple[str, str]]:
  """(importer, imported) where the imported file is on a higher floor."""
  return sorted((a, b) for a, bs in edges.items() for b in bs
                if Floor(b) > Floor(a))


def main() -> int:
  edges = Edges()
  parts = collections.Counter()
  for f in edges:
    parts[Floor(f)] += sum(1 for _ in open(os.path.join(ROOT, f)))
  for i, floor in enumerate(FLOORS):
    print(f'floor {i}: {", ".join(floor)} ({parts[i]} lines)')
  print(f'{len(edges)} files, {sum(map(len, edges.values()))} imports')
  for group in Cycles(edges):
    print('cycle: ' + ' <-> '.join(group))
  for problem in Unplaced(list(edges)):
    print('FLOORS: ' + problem)
  for a, b in Violations(edges):
    print(f'upward: {a} (floor {Floor(a)}) -> {b} (floor {Floor(b)})')
  return 0


if __name__ == '__main__':
  sys.exit(main())
