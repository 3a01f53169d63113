"""Shared test set-up: the repository on sys.path, lingvo_ext imported.

Under pytest-xdist (scripts/test.sh runs --dist loadgroup), the tests that
share a module- or session-scoped fixture of this repository go to one
worker, so the fixture (often a whole training run) runs once, not once per
worker.
"""

import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lingvo_ext  # pylint: disable=unused-import,g-import-not-at-top


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TrainedRun:
  """A finished `python -m lingvo_ext.trainer` run that tests continue.

  Each test goes on from its own copy (Copy), so the run stays as it was
  for the others.
  """

  def __init__(self, logdir, model, flags, output):
    self.logdir, self.model, self.flags = logdir, model, flags
    self.output = output

  def Copy(self, dst):
    """Copies the logdir to dst, its checkpoint list pointing into dst."""
    shutil.copytree(self.logdir, dst)
    state = os.path.join(dst, 'train', 'checkpoint')
    with open(state) as f:
      text = f.read()
    with open(state, 'w') as f:  # The paths in it are absolute.
      f.write(text.replace('"%s/' % self.logdir, '"%s/' % dst))
    return dst


@pytest.fixture(scope='session')
def tiny_gpipe_run(tmp_path_factory):
  """lm.TransformerLmTinyGPipe, K=2 cells on 2 CPU devices, 3 steps.

  Shared by the tests that need a finished pipelined run: the K=2 vs K=1
  loss, resuming across variable stacking, a damaged latest checkpoint.
  """
  logdir = str(tmp_path_factory.mktemp('tiny_gpipe'))
  model = 'lm.TransformerLmTinyGPipe'
  flags = ['--num_cpu_devices=2', '--worker_split_size=2']
  proc = subprocess.run(
      [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={model}',
       f'--logdir={logdir}', '--max_steps=3', *flags], cwd=_ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-5000:]
  return TrainedRun(logdir, model, flags, proc.stdout)


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


# Before pytest-xdist's own hook, which reads the xdist_group marks.
@pytest.hookimpl(tryfirst=True)
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
