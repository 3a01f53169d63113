"""tests/ is laid out like the package, and what names a test file finds it.

The tests of `lingvo_ext/X/` live in `tests/X/`, of `bench/` and `docs/` in
`tests/bench/` and `tests/docs/`; `tests/e2e/` holds whole-command runs and
`tests/support/` what the tests share. Each folder is a package (module names
stay unique at any depth) and test file basenames are unique (Bazel targets,
conftest's stored times and .ci/run's numerics list go by basename). Every
`tests/....py` path the docs, scripts and code name exists.
"""

import collections
import glob
import os
import re

from tests.support import ROOT

# Folders of tests/ that mirror no folder of the package.
_OWN = ('support', 'e2e')
# Top-level folders of the repository that tests/ mirrors besides lingvo_ext/.
_OTHER_MIRRORED = ('bench', 'docs')
# Where a test path may be named: docs, scripts, CI and code.
_NAMING = ('README.md', 'docs/*.md', 'scripts/*', '.ci/run', 'BUILD',
           'pytest.ini', 'mkdocs.yml', 'lingvo_ext/**/*.py', 'bench/*.py',
           'tests/**/*.py')
_TEST_PATH = re.compile(r'(?<![\w/.])tests/[\w/]+\.py\b')


def _TestFolders(root):
  tests = os.path.join(root, 'tests')
  for path, dirs, _ in os.walk(tests):
    # testdata/: a test's files (golden text), not tests.
    dirs[:] = sorted(d for d in dirs if d not in ('__pycache__', 'testdata')
                     and not d.startswith('.'))
    if path != tests:
      yield os.path.relpath(path, tests).replace(os.sep, '/')


def LayoutProblems(root):
  """What breaks the layout under root/tests/, one line each."""
  problems = []
  for folder in _TestFolders(root):
    top = folder.split('/')[0]
    if not os.path.exists(os.path.join(root, 'tests', folder, '__init__.py')):
      problems.append(f'tests/{folder}/ has no __init__.py (each test folder '
                      'is a package)')
    if top in _OWN:
      if folder != top:
        problems.append(f'tests/{folder}/: tests/{top}/ has no subfolders')
      continue
    mirrored = (os.path.isdir(os.path.join(root, 'lingvo_ext', folder)) or
                (top in _OTHER_MIRRORED and
                 os.path.isdir(os.path.join(root, folder))))
    if not mirrored:
      problems.append(f'tests/{folder}/ names no folder of lingvo_ext/ '
                      f'(nor {", ".join(_OTHER_MIRRORED)}): move its tests '
                      'to the folder of the modules they test')
  by_name = collections.defaultdict(list)
  for path in glob.glob(os.path.join(root, 'tests', '**', 'test_*.py'),
                        recursive=True):
    by_name[os.path.basename(path)].append(
        os.path.relpath(path, root).replace(os.sep, '/'))
  for name, paths in sorted(by_name.items()):
    if len(paths) > 1:
      problems.append(f'{name}: one basename for {sorted(paths)} (rename one)')
  return problems


def StalePaths(root):
  """`file: tests/...py` for each test path named in root's docs, scripts
  and code that does not exist."""
  stale = []
  for pattern in _NAMING:
    for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
      if not os.path.isfile(path) or path == os.path.abspath(__file__):
        continue  # This file's own names are a made-up tree's.
      with open(path, encoding='utf-8', errors='replace') as f:
        text = f.read()
      for named in sorted(set(_TEST_PATH.findall(text))):
        if '**' in named or not os.path.exists(os.path.join(root, named)):
          rel = os.path.relpath(path, root)
          stale.append(f'{rel}: {named}')
  return stale


def testTheTestsMirrorThePackage():
  assert LayoutProblems(ROOT) == []


def testEveryTestPathNamedExists():
  assert StalePaths(ROOT) == [], 'a test moved: update where it is named'


def testAFreshCloneSortsItsTestsByTheSavedRunsSeconds():
  # No cache (a fresh clone): conftest's order is the saved run's
  # (scripts/save_test_seconds.py), each key a test file's basename.
  from tests import conftest  # pylint: disable=g-import-not-at-top

  class NoCache:
    cache = None

  saved = conftest._SavedSeconds()  # pylint: disable=protected-access
  assert len(saved) > 1000 and max(saved.values()) > 10
  assert conftest._SecondsBefore(NoCache()) == saved  # pylint: disable=protected-access
  files = {os.path.basename(p) for p in glob.glob(
      os.path.join(ROOT, 'tests', '**', 'test_*.py'), recursive=True)}
  gone = sorted({k.split('::')[0] for k in saved} - files)
  assert not gone, f'{gone}: run scripts/save_test_seconds.py after a run'


def _Tree(root, files):
  for name, text in files.items():
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
      f.write(text)


def testAFolderThatMirrorsNothingADuplicateAndAStalePathAreFound(tmp_path):
  root = str(tmp_path)
  _Tree(root, {
      'lingvo_ext/planner/plans.py': '',
      'bench/pipeline.py': '',
      'tests/__init__.py': '',
      'tests/planner/__init__.py': '',
      'tests/planner/test_plans.py': '',
      'tests/bench/__init__.py': '',
      'tests/bench/test_pipeline.py': '',
      'tests/support/__init__.py': '',
      'tests/e2e/__init__.py': '',
      'tests/e2e/test_trainer.py': '',
  })
  assert LayoutProblems(root) == []
  _Tree(root, {
      'tests/features/__init__.py': '',
      'tests/planner/deep/test_x.py': '',
      'tests/e2e/more/__init__.py': '',
      'tests/e2e/more/test_plans.py': '',
      'docs/a.md': 'see tests/planner/test_plans.py and tests/test_gone.py\n',
  })
  problems = LayoutProblems(root)
  assert len(problems) == 5, problems
  assert 'tests/e2e/more/: tests/e2e/ has no subfolders' in problems
  assert any(p.startswith('tests/features/ names no folder') for p in problems)
  assert any(p.startswith('tests/planner/deep/ has no __init__')
             for p in problems)
  assert any(p.startswith('tests/planner/deep/ names no folder')
             for p in problems)
  assert any(p.startswith('test_plans.py: one basename') for p in problems)
  assert StalePaths(root) == ['docs/a.md: tests/test_gone.py']
