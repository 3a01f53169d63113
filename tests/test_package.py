"""Importing lingvo_ext turns oneDNN off before TensorFlow loads."""

import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _Run(code, **env_overrides):
  env = {k: v for k, v in os.environ.items() if k != 'TF_ENABLE_ONEDNN_OPTS'}
  env.update(env_overrides)
  return subprocess.run([sys.executable, '-c', code], cwd=_REPO, env=env,
                        capture_output=True, text=True, check=True)


def test_onednn_is_off_before_tensorflow_loads():
  out = _Run('import os, sys; import lingvo_ext; '
             'print("tensorflow" in sys.modules, '
             'os.environ["TF_ENABLE_ONEDNN_OPTS"])').stdout.split()
  # Set by the import, and TensorFlow was not loaded first.
  assert out == ['False', '0']


def test_importing_after_tensorflow_warns():
  r = _Run('import tensorflow; import lingvo_ext')
  assert 'set TF_ENABLE_ONEDNN_OPTS=0' in r.stderr
