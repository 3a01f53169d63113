"""XLA's compiled cells kept across processes (lingvo_ext/xla_cache.py)."""

import os
import subprocess
import sys

import pytest

from lingvo_ext import xla_cache
from tests.support import ROOT

TIMEOUT = 300


def _Install(env, monkeypatch):
  """xla_cache.Install() as a program runs it (TensorFlow not imported)."""
  for key in ('TF_XLA_FLAGS', 'XDG_CACHE_HOME'):
    monkeypatch.delenv(key, raising=False)
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  monkeypatch.delitem(sys.modules, 'tensorflow', raising=False)
  return xla_cache.Install()


def test_install_points_tensorflow_at_a_folder_per_cpu(tmp_path, monkeypatch):
  path = _Install({'XDG_CACHE_HOME': str(tmp_path),
                   'TF_XLA_FLAGS': '--tf_xla_auto_jit=0'}, monkeypatch)
  assert path == xla_cache.CacheDir()
  assert path.startswith(str(tmp_path / 'lingvo_ext' / 'xla' / 'tf'))
  assert path.endswith('-' + xla_cache.CpuKey()) and os.path.isdir(path)
  # The user's flags are kept.
  assert os.environ['TF_XLA_FLAGS'] == (
      f'--tf_xla_auto_jit=0 --tf_xla_persistent_cache_directory={path}')


def test_a_users_cache_folder_and_an_imported_tensorflow_are_left(
    tmp_path, monkeypatch):
  mine = '--tf_xla_persistent_cache_directory='
  assert _Install({'XDG_CACHE_HOME': str(tmp_path), 'TF_XLA_FLAGS': mine},
                  monkeypatch) is None
  assert os.environ['TF_XLA_FLAGS'] == mine
  monkeypatch.delenv('TF_XLA_FLAGS')
  monkeypatch.setitem(sys.modules, 'tensorflow', sys)  # Imported already.
  assert xla_cache.Install() is None
  assert 'TF_XLA_FLAGS' not in os.environ
  assert not (tmp_path / 'lingvo_ext').exists()


def test_the_cpu_key_is_the_model_and_its_instruction_sets(monkeypatch):
  key = xla_cache.CpuKey()
  assert len(key) == 12 and key == xla_cache.CpuKey()
  real_open = open

  def OtherFlags(path, *args, **kwargs):
    if path != '/proc/cpuinfo':
      return real_open(path, *args, **kwargs)
    import io  # pylint: disable=g-import-not-at-top
    with real_open(path) as f:
      text = f.read()
    return io.StringIO(text.replace('flags\t\t:', 'flags\t\t: avx512_bf16', 1))

  monkeypatch.setattr('builtins.open', OtherFlags)
  assert xla_cache.CpuKey() != key


@pytest.mark.e2e
def test_the_trainer_keeps_compiled_cells_in_the_cpus_folder(tmp_path):
  # Fresh interpreters: a forked run has its server's TensorFlow flags.
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / 'cache'))
  env.pop('TF_XLA_FLAGS', None)
  losses = []
  for run in ('first', 'second'):
    proc = subprocess.run(
        [sys.executable, '-m', 'lingvo_ext.trainer',
         '--model=lm.TransformerLmTiny', f'--logdir={tmp_path / run}',
         '--max_steps=2', '--model_params_override=task.jit_compile:True'],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    # TensorFlow's read of an entry as text first is not the user's error.
    assert 'Error parsing text-format' not in proc.stdout, proc.stdout
    losses.append([l for l in proc.stdout.splitlines()
                   if l.startswith('step 2/2')])
    folders = list((tmp_path / 'cache' / 'lingvo_ext' / 'xla').iterdir())
    assert len(folders) == 1 and folders[0].name.endswith(xla_cache.CpuKey())
    compiled = sorted(p.name for p in folders[0].iterdir())
    assert compiled and all(n.startswith('xla_compile_cache') for n in compiled)
    if run == 'first':
      first = compiled
  # The second run's cells are the first's: no entry was added. (That it
  # reads them rather than compiling again shows in its CPU time:
  # docs/benchmarks.md, "XLA as a speed choice".)
  assert compiled == first
  assert losses[0] and losses[0][0].split()[:4] == losses[1][0].split()[:4]


@pytest.mark.e2e
def test_the_cells_auto_timed_are_the_ones_a_later_xla_run_reads(tmp_path):
  # jit_compile='auto' compiles the cells in graphs of its own before the
  # trainer's: named by their order in their graph and built with the
  # trainer's session config, they are the trainer's XLA cells, so a later
  # XLA run compiles nothing (and an 'auto' run taking XLA compiles once).
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / 'cache'))
  env.pop('TF_XLA_FLAGS', None)
  compiled = []
  for run, flags in (('auto', ['--jit_auto_min_steps=0']),
                     ('xla', ['--model_params_override=task.jit_compile:True'])):
    proc = subprocess.run(
        [sys.executable, '-m', 'lingvo_ext.trainer',
         '--model=lm.TransformerLmTiny', f'--logdir={tmp_path / run}',
         '--max_steps=2'] + flags,
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    if run == 'auto':
      log = (tmp_path / run / 'log.controller+trainer_client.txt').read_text()
      assert "for task.jit_compile ('auto' took" in log, log[-3000:]
    folder, = (tmp_path / 'cache' / 'lingvo_ext' / 'xla').iterdir()
    compiled.append(sorted(p.name for p in folder.iterdir()))
  assert compiled[0] and compiled[1] == compiled[0], compiled
