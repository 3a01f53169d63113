"""Every runnable example of README.md and docs/ runs; every error is documented.

A code block is runnable when an HTML comment `<!-- runnable -->` is on the
line before its fence (options: tests/docs_testlib.py). Each runs as written,
from a fresh temporary directory that has a `.venv` link to this checkout's
venv (so `.venv/bin/python -m ...` works there) and that venv's bin first on
PATH (so the console scripts do); `/tmp/lx/` in the block becomes a
directory of the test's own. A block that exits non-zero fails the test,
with its output.
"""

import os
import re
import subprocess
import sys

import pytest

from tests import docs_testlib as docs_lib

ROOT = docs_lib.ROOT
TIMEOUT = 600
BLOCKS = docs_lib.RunnableBlocks()


def _Params():
  out = []
  for block in BLOCKS:
    if block.file:
      continue  # Written by the blocks of its page that use it.
    marks = [pytest.mark.e2e] if block.e2e else []
    out.append(pytest.param(block, id=block.id, marks=marks))
  return out


def _Run(block, tmp_path):
  lx = str(tmp_path / 'lx')
  os.makedirs(lx, exist_ok=True)
  work = tmp_path / 'cwd'
  work.mkdir()
  os.symlink(os.path.join(ROOT, '.venv'), str(work / '.venv'))
  # The files this block's page writes first (e.g. an experiment module).
  for other in BLOCKS:
    if other.path == block.path and other.file and other.line < block.line:
      path = other.file.replace('/tmp/lx/', lx + '/')
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, 'w', encoding='utf-8') as f:
        f.write(other.code.replace('/tmp/lx/', lx + '/') + '\n')
  code = block.code.replace('/tmp/lx/', lx + '/')
  env = dict(os.environ)
  env['PATH'] = os.path.join(ROOT, '.venv', 'bin') + os.pathsep + env['PATH']
  env.pop('PYTHONPATH', None)
  if block.lang == 'sh':
    cmd = ['bash', '-euo', 'pipefail', '-c', code]
  else:
    cmd = [os.path.join(ROOT, '.venv', 'bin', 'python'), '-c', code]
  proc = subprocess.run(cmd, cwd=ROOT if block.cwd_repo else str(work),
                        env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
                        check=False)
  assert proc.returncode == 0, '%s exited %d:\n%s' % (
      block.id, proc.returncode, proc.stdout[-5000:])
  return proc.stdout


@pytest.mark.parametrize('block', _Params())
def testRunnableExampleRuns(block, tmp_path):
  _Run(block, tmp_path)


def testEveryPageHasRunnableExamplesAndMarkersParse():
  pages = {b.path for b in BLOCKS}
  for page in ('README.md', 'docs/quickstart.md', 'docs/schedules.md'):
    assert page in pages, page
  for block in BLOCKS:
    assert block.code.strip(), block.id
    # The venv's python or a console script, never a bare python.
    assert not re.search(r'(^|[\s;|&(])python3?\s', block.code), block.id


def testNoBarePythonCommandInDocs():
  bare = re.compile(r'(?<![/\w.-])python3? -m ')
  for pattern in docs_lib.DOC_FILES:
    for path in sorted(__import__('glob').glob(os.path.join(ROOT, pattern))):
      with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
          assert not bare.search(line), '%s:%d: %s' % (path, n, line)


def testEveryErrorLineIsInTroubleshooting():
  with open(os.path.join(ROOT, 'docs', 'troubleshooting.md'),
            encoding='utf-8') as f:
    page = docs_lib.Words(f.read())
  templates = docs_lib.ErrorTemplates()
  assert len(templates) > 20  # The extraction still finds the messages.
  missing = ['%s:%d: %s' % (path, line, text)
             for path, line, text in templates
             if docs_lib.LongestLiteral(text) not in page]
  assert not missing, ('error lines not in docs/troubleshooting.md:\n' +
                       '\n'.join(missing))


def testScheduleValuesInDocsAreTheSchedules():
  from lingvo_ext.core import schedules  # pylint: disable=g-import-not-at-top
  with open(os.path.join(ROOT, 'docs', 'schedules.md'),
            encoding='utf-8') as f:
    page = f.read()
  for name in schedules.SCHEDULES:
    assert "`'%s'`" % name in page, name


if __name__ == '__main__':
  sys.exit(pytest.main([__file__]))


# Every library file: a param or flag help is 1-3 lines; the detail is in
# docs/.
_SHORT_HELP_FILES = ['lingvo_ext/**/*.py']
# About 3 lines of 80 characters.
_MAX_HELP = 240


def _Helps(path):
  import ast  # pylint: disable=g-import-not-at-top
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  for n in ast.walk(tree):
    if not isinstance(n, ast.Call):
      continue
    name = getattr(n.func, 'attr', getattr(n.func, 'id', ''))
    node = None
    if (name == 'Define' or name.startswith('DEFINE_')) and len(n.args) >= 3:
      node = n.args[2]
    elif name == 'add_argument':
      node = next((k.value for k in n.keywords if k.arg == 'help'), None)
    text = docs_lib._Lead(node) if node is not None else None  # pylint: disable=protected-access
    if text is not None:
      yield n.lineno, text


def testParamAndFlagHelpsAreShort():
  import glob  # pylint: disable=g-import-not-at-top
  long_helps = []
  for pattern in _SHORT_HELP_FILES:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern),
                                 recursive=True)):
      for line, text in _Helps(path):
        if len(text) > _MAX_HELP:
          long_helps.append('%s:%d: %d characters' % (
              os.path.relpath(path, ROOT), line, len(text)))
  assert not long_helps, '\n'.join(long_helps)
