"""A quiet first line: TensorFlow's start-up noise filtered, nothing else."""

import logging
import os
import subprocess
import sys

import pytest

from lingvo_ext import _startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_NOISE = [
    'WARNING: All log messages before absl::InitializeLog() is called are '
    'written to STDERR',
    'I0000 00:00:1795749979.555950    7885 cudart_stub.cc:31] Could not find '
    'cuda drivers on your machine, GPU will not be used.',
    'I0000 00:00:1795749979.555950    7885 port.cc:153] oneDNN custom '
    'operations are on. You may see slightly different numerical results.',
]
_CUINIT = ('E0000 00:00:1795750284.988622   13556 cuda_platform.cc:52] failed '
           'call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: '
           'UNKNOWN ERROR (303)')


def _Filtered(lines, chunk=7):
  out = []
  f = _startup.LineFilter(out.append)
  data = ''.join(l + '\n' for l in lines).encode()
  for i in range(0, len(data), chunk):  # Lines split across reads.
    f.Feed(data[i:i + chunk])
  f.Close()
  return [l.decode() for l in out]


def test_filter_drops_the_known_lines_only():
  real = ['E0000 00:00:1.0 1 some_kernel.cc:1] a real error',
          'Traceback (most recent call last):']
  assert _Filtered(_NOISE + [real[0], _CUINIT, real[1]]) == [
      real[0] + '\n', real[1] + '\n']
  # cuInit's failure where cudart found a driver is a real error.
  assert _Filtered([_NOISE[0], _CUINIT]) == [_CUINIT + '\n']
  # A last line without a newline is passed on too.
  out = []
  f = _startup.LineFilter(out.append)
  f.Feed(b'partial')
  f.Close()
  assert out == [b'partial']


def test_filtered_stderr_passes_real_lines_through_fd_2(capfd):
  with _startup.FilteredStderr() as f:
    os.write(2, ('\n'.join(_NOISE) + '\nkept\n').encode())
  assert f.dropped == len(_NOISE)
  assert capfd.readouterr().err == 'kept\n'


def _Env(**extra):
  env = {k: v for k, v in os.environ.items()
         if k not in (_startup.LEVEL_VAR, _startup._MARK)}  # pylint: disable=protected-access
  env.update(extra)
  return env


def _Run(args, **env):
  return subprocess.run([sys.executable, '-m', 'lingvo_ext.trainer'] + args,
                        cwd=ROOT, env=_Env(**env), capture_output=True,
                        text=True, timeout=600, stdin=subprocess.DEVNULL)


def _RunMerged(args):
  # One stream, unbuffered: its first line is the first the user sees.
  return subprocess.run([sys.executable, '-m', 'lingvo_ext.trainer'] + args,
                        cwd=ROOT, env=_Env(PYTHONUNBUFFERED='1'),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, timeout=600, stdin=subprocess.DEVNULL)


@pytest.mark.e2e
def test_first_line_is_ours(tmp_path):
  # A fresh interpreter each (the forked runs' server imported TensorFlow).
  helped = _Run(['--help'])
  assert helped.returncode == 0 and helped.stderr == '', helped.stderr
  assert helped.stdout.startswith('Trains or evaluates'), helped.stdout[:200]
  bad = _Run(['--model=lm.NoSuchModel'])
  assert bad.returncode == 2
  assert bad.stderr.startswith("error: Unknown model 'lm.NoSuchModel'"), (
      bad.stderr[:500])
  # A one-line error found once TensorFlow is loaded (the params built).
  bad = _Run(['--model=lm.TransformerLmTiny', f'--logdir={tmp_path}/bad',
              '--model_params_override=task.nope:1'])
  assert bad.returncode == 2 and bad.stdout == '', bad.stdout[:500]
  assert bad.stderr.startswith("error: --model_params_override: unknown key "
                               "'task.nope'") and bad.stderr.count('\n') == 1, (
                                   bad.stderr[:500])
  ran = _RunMerged(['--model=lm.TransformerLmTiny', '--max_steps=1',
                    f'--logdir={tmp_path}'])
  assert ran.returncode == 0, ran.stdout[-2000:]
  assert ran.stdout.startswith('lingvo_ext.trainer: '), ran.stdout[:500]
  # The user's own level wins: TensorFlow's start-up shows as it is.
  loud = subprocess.run(
      [sys.executable, '-c', 'import lingvo_ext, tensorflow'], cwd=ROOT,
      env=_Env(TF_CPP_MIN_LOG_LEVEL='0'), capture_output=True, text=True,
      timeout=600)
  assert loud.returncode == 0 and ('cudart_stub' in loud.stderr or
                                   'cpu_feature_guard' in loud.stderr), (
                                       loud.stderr)


def test_repeated_lingvo_warnings_show_once_with_a_note():
  f = _startup.RepeatFilter()

  def Record(msg, *args):
    return logging.LogRecord('tensorflow', logging.WARNING, __file__, 1, msg,
                             args, None)

  xavier = 'WARNING!!! var %s is using the default xavier initializer.'
  first = Record(xavier, 'a/w')
  assert f.filter(first) and 'a/w' in first.getMessage()
  assert 'further ones are not logged' in first.getMessage()
  assert not f.filter(Record(xavier, 'b/w'))
  cell = Record('cell_fn contains stateful ops: %s', ['CheckNumerics'])
  assert f.filter(cell) and 'CheckNumerics' in cell.getMessage()
  assert not f.filter(Record('cell_fn contains stateful ops: %s', []))
  assert f.filter(Record('anything else'))
  assert f.filter(Record('anything else'))


def test_harmless_attention_overrides_show_once_others_always():
  f = _startup.RepeatFilter()

  def Record(msg):
    return logging.LogRecord('absl', logging.WARNING, __file__, 1, msg, (),
                             None)

  first = Record('attention param input_dim overriding: 0 -> 32')
  assert f.filter(first)
  assert 'as intended; further ones are not logged' in first.getMessage()
  # Template defaults (or equal values) filled in: hidden after the first.
  for msg in ('attention param hidden_dim overriding: 0 -> 32',
              'attention param num_heads overriding: 1 -> 4',
              'attention param name overriding:  -> multihead_atten',
              'attention param atten_dropout_prob overriding: 0.1 -> 0.1',
              'attention param input_dim overriding: 0 -> 64'):
    assert not f.filter(Record(msg)), msg
  # A value the user set on the template, replaced: always shown, as is.
  for _ in range(2):
    kept = Record('attention param num_heads overriding: 8 -> 4')
    assert f.filter(kept)
    assert kept.getMessage().endswith('8 -> 4')
