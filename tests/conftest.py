"""Shared test set-up: the repository on sys.path, lingvo_ext imported.

Under pytest-xdist (scripts/test.sh runs --dist loadgroup), the tests that
share a module- or session-scoped fixture of this repository go to one
worker, so the fixture (often a whole training run) runs once, not once per
worker.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lingvo_ext  # pylint: disable=unused-import,g-import-not-at-top


def _SharedFixtures(item):
  """This repository's module/session fixtures that item uses, as ids."""
  info = getattr(item, '_fixtureinfo', None)
  ids = []
  for name in getattr(item, 'fixturenames', ()):
    defs = info.name2fixturedefs.get(name) if info else None
    # Plugins' fixtures (tmp_path_factory, ...) have an empty baseid.
    if defs and defs[-1].baseid and defs[-1].scope in ('module', 'session'):
      where = os.path.splitext(os.path.basename(defs[-1].baseid))[0]
      ids.append('%s.%s' % (where, name))
  return ids


def pytest_collection_modifyitems(items):
  # One xdist_group per set of tests linked by shared fixtures (union-find).
  parent = {}

  def Find(x):
    while parent.setdefault(x, x) != x:
      x = parent[x]
    return x

  shared = {item: _SharedFixtures(item) for item in items}
  for ids in shared.values():
    for other in ids[1:]:
      parent[Find(other)] = Find(ids[0])
  for item, ids in shared.items():
    if ids and not item.get_closest_marker('xdist_group'):
      item.add_marker(pytest.mark.xdist_group(Find(ids[0])))
  # The end-to-end tests are the long ones: started first, they do not leave
  # one pytest-xdist worker busy at the end while the others wait.
  items.sort(key=lambda item: item.get_closest_marker('e2e') is None)
