"""Every example of README.md and docs/ runs or is checked; every error is documented.

Every shell and Python code block has an HTML comment on the line before its
fence that says how it is checked (tests/support/docs_testlib.py lists the
forms).
A `<!-- runnable -->` block runs as written (with the marker's `sub=`
substitutions), from a fresh temporary directory that has a `.venv` of
links to this checkout's venv (so `.venv/bin/python -m ...` works there) and
that venv's bin first on PATH (so the console scripts do); `/tmp/lx/` in the
block becomes a directory of the test's own. Its `.venv/bin/python -m
lingvo_ext...` and `.venv/bin/python -c` runs (a Python block's too) are
forked from a server that has imported TensorFlow
(tests/support/zygote.py's Bridge; LINGVO_EXT_TEST_ZYGOTE=0: each a fresh
interpreter), as the other tests' tool runs are. A block that exits non-zero
fails the test, with its output. A `<!-- checked: ... -->` block (commands
for other hosts, a fragment of a tested file) is checked as its kind says.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.support import docs_commands_testlib as commands_lib
from tests.support import docs_testlib as docs_lib
from tests.support import zygote

ROOT = docs_lib.ROOT
TIMEOUT = 600
BLOCKS = docs_lib.FencedBlocks()
RUNNABLE = [b for b in BLOCKS if b.kind == 'runnable']
CHECKED = [b for b in BLOCKS if b.kind == 'checked']


def _Chains():
  """Each runnable block with the `after` blocks that follow it."""
  chains = []
  for block in RUNNABLE:
    if block.file:
      continue  # Written by the blocks of its page that use it.
    if block.after:
      if not chains or chains[-1][-1].path != block.path:
        raise ValueError('%s: after, but no runnable block before it.' %
                         block.id)
      chains[-1].append(block)
    else:
      chains.append([block])
  return chains


def _Params():
  out = []
  for chain in _Chains():
    marks = [pytest.mark.e2e] if any(b.e2e for b in chain) else []
    out.append(pytest.param(chain, id=chain[0].id, marks=marks))
  return out


def _WriteFiles(block, lx):
  """The files this block's page writes first (e.g. an experiment module)."""
  for other in RUNNABLE:
    if other.path == block.path and other.file and other.line < block.line:
      path = other.file.replace('/tmp/lx/', lx + '/')
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, 'w', encoding='utf-8') as f:
        f.write(other.code.replace('/tmp/lx/', lx + '/') + '\n')


def _Env(block, lx):
  env = dict(os.environ)
  env['PATH'] = os.path.join(ROOT, '.venv', 'bin') + os.pathsep + env['PATH']
  env.pop('PYTHONPATH', None)
  for name, value in block.env:
    env[name] = value.replace('/tmp/lx/', lx + '/')
  return env


@pytest.fixture(scope='session')
def bridge():
  """bridge(): this worker's tests/support/zygote.py Bridge, made on first
  use: a block's `.venv/bin/python -m lingvo_ext...` runs are forked from the
  worker's zygote server, not each a fresh interpreter importing
  TensorFlow."""
  made = []

  def Get():
    if not made:
      # A short path: a Unix socket's is at most 107 bytes.
      directory = tempfile.mkdtemp(prefix='zygote-bridge-')
      made.append((zygote.Bridge(directory), directory))
    return made[0][0]

  yield Get
  for b, directory in made:
    b.Close()
    shutil.rmtree(directory, ignore_errors=True)


def _Venv(work, bridge):
  """work/.venv: the venv, its bin/python bridge's shim (if any)."""
  venv = os.path.join(ROOT, '.venv')
  if bridge is None:
    os.symlink(venv, str(work / '.venv'))
    return
  os.makedirs(str(work / '.venv' / 'bin'))
  for name in os.listdir(venv):
    if name != 'bin':
      os.symlink(os.path.join(venv, name), str(work / '.venv' / name))
  for name in os.listdir(os.path.join(venv, 'bin')):
    if name != 'python':
      os.symlink(os.path.join(venv, 'bin', name),
                 str(work / '.venv' / 'bin' / name))
  shim = work / '.venv' / 'bin' / 'python'
  shim.write_text(bridge.Shim())
  shim.chmod(0o755)


def _Run(block, tmp_path, bridge=None):
  lx = str(tmp_path / 'lx')
  os.makedirs(lx, exist_ok=True)
  work = tmp_path / 'cwd'
  if not work.exists():
    work.mkdir()
    _Venv(work, bridge)
  _WriteFiles(block, lx)
  code = block.Code().replace('/tmp/lx/', lx + '/')
  if block.lang == 'sh':
    cmd = ['bash', '-euo', 'pipefail', '-c', code]
  else:
    # The venv's python as the page says, `.venv/bin/python -c` (bridge's
    # shim, if any: forked).
    cmd = [str(work / '.venv' / 'bin' / 'python'), '-c', code]
  proc = subprocess.run(cmd, cwd=ROOT if block.cwd_repo else str(work),
                        env=_Env(block, lx), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
                        check=False)
  assert proc.returncode == 0, '%s exited %d:\n%s' % (
      block.id, proc.returncode, proc.stdout[-5000:])
  return proc.stdout


@pytest.mark.parametrize('chain', _Params())
def testRunnableExampleRuns(chain, tmp_path, bridge):
  # Blocks that run no trainer or tool (not e2e) need no server; with
  # LINGVO_EXT_TEST_ZYGOTE=0 every run is a fresh interpreter.
  served = zygote.ENABLED and any(b.e2e for b in chain)
  for block in chain:
    _Run(block, tmp_path, bridge() if served else None)


def testEveryCodeBlockIsRunOrChecked():
  """No shell or Python block goes unchecked; every fence names a language."""
  unmarked = ['%s (```%s)' % (b.id, b.lang) for b in BLOCKS
              if not b.lang or (b.lang in docs_lib.CODE_LANGS and not b.kind)]
  assert not unmarked, (
      'give each block a language (text for output) and each shell or '
      'Python block a marker (tests/support/docs_testlib.py):\n' +
      '\n'.join(unmarked))
  indented = docs_lib.IndentedCommands()
  assert not indented, ('fence these indented code blocks and mark them:\n' +
                        '\n'.join(indented))
  code = [b for b in BLOCKS if b.lang in docs_lib.CODE_LANGS]
  assert len(code) == len([b for b in RUNNABLE if b.lang in
                           docs_lib.CODE_LANGS]) + len(
                               [b for b in CHECKED if b.lang in
                                docs_lib.CODE_LANGS])
  for block in RUNNABLE:
    block.Code()  # Each sub= still finds its text.
  assert len(_Chains()) >= 30  # The extraction still finds the examples.


def _CheckCommands(items, env=None):
  """Runs CheckCommandsMain on items in a process of its own, forked by
  tests/support/zygote.py where it can be (the trainer's and most bench scripts'
  parsers import TensorFlow); asserts each is ok."""
  with tempfile.TemporaryDirectory(prefix='check-commands-') as tmp:
    path = os.path.join(tmp, 'items.json')
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(items, f)
    proc = zygote.run(
        [sys.executable, '-c',
         'import sys; sys.stdin = open(sys.argv[1]); '
         'from tests.support import docs_commands_testlib as c; '
         'sys.exit(c.CheckCommandsMain())', path],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=TIMEOUT, check=False)
  assert proc.returncode == 0, proc.stdout[-5000:]
  assert proc.stdout.count(': ok\n') == len(items), proc.stdout


def _Commands(block, tmp_path):
  """[(PYTHONPATH, argv)] of the python commands a `checked` block runs.

  The block runs with fakes for the venv's python, bash and docker that
  record their arguments; a script that bash would run must exist, and
  docker builds from the repository's Dockerfile.
  """
  lx = str(tmp_path / 'lx')
  os.makedirs(lx, exist_ok=True)
  _WriteFiles(block, lx)
  work = tmp_path / 'cwd'
  fakes = tmp_path / 'fakes'
  os.makedirs(str(work / '.venv' / 'bin'))
  os.makedirs(str(fakes))
  for fake in (str(work / '.venv' / 'bin' / 'python'), str(fakes / 'bash'),
               str(fakes / 'docker')):
    with open(fake, 'w', encoding='utf-8') as f:
      f.write(commands_lib.FAKE_PYTHON % os.path.join(ROOT, '.venv', 'bin',
                                                  'python'))
    os.chmod(fake, 0o755)
  if block.check == 'flags':
    lines = [l for l in block.code.split('\n')
             if l.strip() and not l.startswith('#')]
    code = '\n'.join('%s %s' % (block.base, l) for l in lines)
  else:
    code = block.code
  env = _Env(block, lx)
  env['PATH'] = str(fakes) + os.pathsep + os.environ['PATH']
  env['DOCS_COMMANDS'] = str(tmp_path / 'commands.jsonl')
  subprocess.run([shutil.which('bash'), '-euo', 'pipefail', '-c',
                  code.replace('/tmp/lx/', lx + '/')], cwd=str(work), env=env,
                 check=True, timeout=60)
  commands, scripts = [], []
  with open(env['DOCS_COMMANDS'], encoding='utf-8') as f:
    for line in f:
      pythonpath, (name, *argv) = json.loads(line)
      if name == 'bash':
        assert os.path.exists(os.path.join(ROOT, argv[0])), (block.id, argv)
        scripts.append(argv[0])
      elif name == 'docker':
        # Built at the repository's root, from its Dockerfile, under the
        # image name the Kubernetes manifest runs (tests/test_dockerfile.py).
        assert argv[0] in ('build', 'run', 'tag', 'push'), (block.id, argv)
        if argv[0] == 'build':
          assert argv[-1] == '.' and os.path.exists(
              os.path.join(ROOT, 'Dockerfile')), (block.id, argv)
        scripts.append(argv[0])
      else:
        commands.append((pythonpath, argv))
  assert commands or scripts, '%s runs no command' % block.id
  return commands


@pytest.mark.e2e
@pytest.mark.parametrize('block', [
    pytest.param(b, id=b.id) for b in CHECKED
    if b.check in ('commands', 'flags')])
def testCheckedCommandsPassTheirParsersAndChecks(block, tmp_path):
  commands = _Commands(block, tmp_path)
  by_path = {}
  for pythonpath, argv in commands:
    by_path.setdefault(pythonpath, []).append(argv)
  for pythonpath, argvs in by_path.items():
    _CheckCommands(argvs, dict(os.environ, PYTHONPATH=pythonpath))


@pytest.mark.e2e
def testSlurmAndKubernetesExamplesPassTheTrainersChecks(tmp_path):
  """Each task's trainer command, in the environment it gets there."""
  # pylint: disable=g-import-not-at-top
  import stat

  from lingvo_ext.distributed import resolvers
  from tests.support import k8s_testlib
  items = []
  for job in [d for d in k8s_testlib.Documents() if d['kind'] == 'Job']:
    (container,) = job['spec']['template']['spec']['containers']
    command = container['command'] + container['args']
    assert command[:3] == ['python', '-m', 'lingvo_ext.trainer'], command
    for index in range(job['spec']['completions']):
      env = k8s_testlib.PodEnv(container, index, job['metadata']['name'])
      items.append(dict(env=env, argv=command[1:]))
  # The sbatch script, with an srun that records its command.
  srun = tmp_path / 'bin' / 'srun'
  srun.parent.mkdir()
  record = tmp_path / 'srun.json'
  srun.write_text(f'#!{sys.executable}\nimport json, sys\n'
                  f'json.dump(sys.argv[1:], open({str(record)!r}, "w"))\n')
  srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, PATH=f'{srun.parent}:{os.environ["PATH"]}',
             HOME=str(tmp_path), SLURM_JOB_NUM_NODES='2', SLURM_NTASKS='5',
             SLURM_JOB_NODELIST='node[1-2]')
  env.pop('LOGDIR', None)
  subprocess.run(['bash', os.path.join(ROOT, 'docs', 'slurm',
                                       'lingvo_ext.sbatch')],
                 env=env, check=True, timeout=30)
  argv = json.loads(record.read_text())
  command = argv[argv.index('python') + 1:]
  for rank in range(5):
    items.append(dict(env=resolvers.SlurmEnv(['node1', 'node2'], [3, 2], rank),
                      argv=command))
  _CheckCommands(items)


def testCheckedExcerptsAndBazelBlocks():
  kinds = set()
  for block in CHECKED:
    kinds.add(block.check)
    if block.check == 'excerpt':
      assert docs_lib.Excerpt(block) is None, docs_lib.Excerpt(block)
    elif block.check == 'bazel':
      assert not docs_lib.BazelProblems(block), docs_lib.BazelProblems(block)
  assert {'excerpt', 'bazel'} <= kinds


def testEveryPageHasRunnableExamplesAndMarkersParse():
  pages = {b.path for b in RUNNABLE}
  for page in ('README.md', 'docs/quickstart.md', 'docs/schedules.md'):
    assert page in pages, page
  for block in RUNNABLE:
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
  from lingvo_ext.pipeline import schedules  # pylint: disable=g-import-not-at-top
  with open(os.path.join(ROOT, 'docs', 'schedules.md'),
            encoding='utf-8') as f:
    page = f.read()
  for name in schedules.SCHEDULES:
    assert "`'%s'`" % name in page, name



# Every library file: a param or flag help is 1-3 lines; the detail is in
# docs/.
_SHORT_HELP_FILES = ['lingvo_ext/**/*.py', 'bench/**/*.py']
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


# A date, a time of day or a commit hash: figures and their dates belong in
# docs/benchmarks.md, never in the code (comments say why, not when).
_WHEN = re.compile(r'\b20\d\d-[01]\d-[0-3]\d\b|\b[0-2]?\d:[0-5]\d ?UTC\b|\bUTC\b'
                   r'|\bcommit [0-9a-f]{7,40}\b|\b[0-9a-f]{40}\b')
_CODE_DIRS = ['lingvo_ext/**/*.py', 'bench/**/*.py', 'scripts/*.py',
              'scripts/*.sh']


def testNoDatesTimesOrHashesInCode():
  import glob  # pylint: disable=g-import-not-at-top
  found = []
  for pattern in _CODE_DIRS:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern),
                                 recursive=True)):
      with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
          if _WHEN.search(line):
            found.append('%s:%d: %s' % (os.path.relpath(path, ROOT), n,
                                        line.strip()))
  assert not found, '\n'.join(found)


def testNoTimeOfDayInReadmeOrDocs():
  import glob  # pylint: disable=g-import-not-at-top
  time_of_day = re.compile(r'\b[0-2]?\d:[0-5]\d(:[0-5]\d)? ?(UTC|GMT|CET)\b'
                           r'|\bUTC\b')
  found = []
  for pattern in docs_lib.DOC_FILES:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
      with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
          if time_of_day.search(line):
            found.append('%s:%d: %s' % (os.path.relpath(path, ROOT), n,
                                        line.strip()))
  assert not found, '\n'.join(found)

if __name__ == '__main__':
  sys.exit(pytest.main([__file__]))
