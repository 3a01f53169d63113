"""Importing lingvo_ext leaves oneDNN to the user and TensorFlow's default."""

import os
import subprocess
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = ('import os, sys; import lingvo_ext; '
          'loaded = "tensorflow" in sys.modules; '
          'from tensorflow.python.util import _pywrap_util_port as port; '
          'print(loaded, os.environ.get("TF_ENABLE_ONEDNN_OPTS"), '
          'port.IsMklEnabled())')


def _Run(code, **env_overrides):
  env = {k: v for k, v in os.environ.items() if k != 'TF_ENABLE_ONEDNN_OPTS'}
  env.update(env_overrides)
  return subprocess.run([sys.executable, '-c', code], cwd=_REPO, env=env,
                        capture_output=True, text=True, check=True)


def test_import_does_not_set_onednn():
  loaded, setting, _ = _Run(_PROBE).stdout.split()
  assert (loaded, setting) == ('False', 'None')


@pytest.mark.parametrize('setting,enabled', [('0', 'False'), ('1', 'True')])
def test_users_setting_wins(setting, enabled):
  out = _Run(_PROBE, TF_ENABLE_ONEDNN_OPTS=setting).stdout.split()
  # TensorFlow loads after lingvo_ext and sees the user's choice.
  assert out == ['False', setting, enabled]


def test_importing_after_tensorflow_is_quiet():
  r = _Run('import tensorflow; import lingvo_ext')
  assert 'TF_ENABLE_ONEDNN_OPTS' not in r.stderr
