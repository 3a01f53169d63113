"""The Dockerfile builds the image the Kubernetes manifest runs, installed
as the README installs: with scripts/venv.sh itself, never its own copy of
the install's steps.

Docker is not run here: the test reads the Dockerfile, its .dockerignore
and the install script, and checks they agree.
"""

import fnmatch
import os
import re
import subprocess

from tests.support import ROOT
from tests.support import k8s_testlib


def _Instructions():
  """[(INSTRUCTION, arguments)] of the Dockerfile, comments dropped."""
  with open(os.path.join(ROOT, 'Dockerfile')) as f:
    text = f.read().replace('\\\n', ' ')
  out = []
  for line in text.splitlines():
    if line.strip() and not line.lstrip().startswith('#'):
      word, _, rest = line.strip().partition(' ')
      out.append((word.upper(), rest.strip()))
  return out


def _Ignored(path, patterns):
  """Whether Docker leaves `path` (relative, '/'-separated) out of the
  context: `name` patterns match a top-level entry, `**/name` ones an entry
  at any depth (the only two forms the .dockerignore uses)."""
  parts = path.split('/')
  for p in patterns:
    anywhere = p.startswith('**/')
    name = p[3:] if anywhere else p
    assert '/' not in name, p
    if any(fnmatch.fnmatch(part, name)
           for part in (parts if anywhere else parts[:1])):
      return True
  return False


def testTheImageInstallsWithTheReadmesScriptAndIsTheOneTheManifestRuns():
  steps = _Instructions()
  kinds = [k for k, _ in steps]
  (base,) = [a for k, a in steps if k == 'FROM']
  with open(os.path.join(ROOT, 'scripts', 'venv.sh')) as f:
    venv_sh = f.read()
  # The Python venv.sh creates the venv with is the base image's.
  python = re.search(r'py="\$\{PYTHON:-python(3\.\d+)\}"', venv_sh).group(1)
  assert base.startswith(f'python:{python}-'), base
  # Debian 12 (glibc 2.36): venv.sh's x_ops fix is what makes Lingvo's ops
  # load there.
  assert base.endswith('-bookworm'), base
  assert 'lingvo_ext.tools.fix_x_ops' in venv_sh
  (workdir,) = [a for k, a in steps if k == 'WORKDIR']
  runs = [a for k, a in steps if k == 'RUN']
  assert any(r.startswith('bash scripts/venv.sh') for r in runs), runs
  # The install's steps are venv.sh's alone.
  assert not any('pip' in r.replace('.cache/pip', '') for r in runs), runs
  assert ('COPY', '. .') in steps
  assert kinds.index('COPY') < kinds.index('RUN')
  # `python` in the manifest's command is the venv's.
  (env,) = [a for k, a in steps if k == 'ENV']
  assert env.startswith(f'PATH={workdir}/.venv/bin:'), env
  # The tag the Dockerfile's header builds is the manifest's image.
  with open(os.path.join(ROOT, 'Dockerfile')) as f:
    tag = re.search(r'docker build -t (\S+) \.', f.read()).group(1)
  for name, job in k8s_testlib.Jobs().items():
    for c in job['spec']['template']['spec']['containers']:
      assert c['image'] == tag, name
      assert c['command'][:3] == ['python', '-m', 'lingvo_ext.trainer'], name


def testTheBuildContextHoldsWhatTheInstallReadsAndNoVenv():
  with open(os.path.join(ROOT, '.dockerignore')) as f:
    patterns = [l.strip() for l in f
                if l.strip() and not l.startswith('#')]
  # A venv holds the host's absolute paths: never copied into the image.
  for path in ('.venv/bin/python', '.venv-torch/bin/python', '.git/HEAD',
               'lingvo_ext/__pycache__/x.pyc'):
    assert _Ignored(path, patterns), path
  tracked = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
  # Every file of the checkout is in the context: venv.sh reads the
  # requirements, constraints and pyproject.toml, installs lingvo_ext/ and
  # runs its fix.
  left_out = [p for p in tracked if _Ignored(p, patterns)]
  assert not left_out, left_out
  for needed in ('requirements.txt', 'requirements-nodeps.txt',
                 'constraints.txt', 'pyproject.toml', 'scripts/venv.sh',
                 'lingvo_ext/tools/fix_x_ops.py'):
    assert needed in tracked, needed
