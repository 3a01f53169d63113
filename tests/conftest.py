"""Shared test set-up: the repository on sys.path, lingvo_ext imported.

Under pytest-xdist (scripts/test.sh), a session fixture runs once per
worker; tiny_gpipe_run runs once in all, the other workers waiting on a
file lock and reusing its logdir (the pattern pytest-xdist documents).
"""

import fcntl
import json
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
def tiny_gpipe_run(tmp_path_factory, worker_id):
  """lm.TransformerLmTinyGPipe, K=2 cells on 2 CPU devices, 3 steps.

  Shared by the tests that need a finished pipelined run: the K=2 vs K=1
  loss, resuming across variable stacking, a damaged latest checkpoint.
  Tests only read it or continue in a copy (TrainedRun.Copy).
  """
  model = 'lm.TransformerLmTinyGPipe'
  flags = ['--num_cpu_devices=2', '--worker_split_size=2']
  # The parent of this worker's basetemp is shared by all workers of a run.
  shared = tmp_path_factory.getbasetemp()
  if worker_id != 'master':
    shared = shared.parent
  logdir = str(shared / 'tiny_gpipe_run')
  done = logdir + '.json'
  with open(logdir + '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
    if os.path.exists(done):
      with open(done) as f:
        return TrainedRun(logdir, model, flags, json.load(f)['output'])
    proc = subprocess.run(
        [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={model}',
         f'--logdir={logdir}', '--max_steps=3', *flags], cwd=_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-5000:]
    with open(done, 'w') as f:
      json.dump({'output': proc.stdout}, f)
  return TrainedRun(logdir, model, flags, proc.stdout)


def pytest_collection_modifyitems(items):
  # The end-to-end tests are the long ones: started first, they do not leave
  # one pytest-xdist worker busy at the end while the others wait.
  items.sort(key=lambda item: item.get_closest_marker('e2e') is None)
