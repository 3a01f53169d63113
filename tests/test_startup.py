"""A quiet first line: TensorFlow's start-up noise filtered, nothing else."""

import logging
import os
import subprocess
import sys

import pytest

from lingvo_ext import _startup
from tests.support import ROOT

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


# --- Grappler's cycle lines under the list schedules -------------------------

_REMAPPER = (
    "E0000 00:00:1795874899.571565   18113 meta_optimizer.cc:967] remapper "
    "failed: INVALID_ARGUMENT: MutableGraphView::SortTopologically error: "
    "detected edge(s) creating cycle(s) {'gradients/a/bwd_gate' -> 'b'}")
_DEPENDENCY = (
    "E0000 00:00:1795874899.624446   18113 dependency_optimizer.cc:773] "
    "Iteration = 0, topological sort failed with message: The graph couldn't "
    "be sorted in topological order.")


def _GrapplerFiltered(data, chunks=1):
  """What the Grappler filter's process passes on of `data`, fed in parts."""
  proc = subprocess.Popen(
      [sys.executable, '-S', '-c', _startup._FILTER_PROGRAM,  # pylint: disable=protected-access
       _startup.GRAPPLER_NOTE, *_startup.GRAPPLER_CYCLES,
       *_startup.XLA_CACHE_READS],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  step = -(-len(data) // chunks)
  for i in range(0, len(data), step):
    proc.stdin.write(data[i:i + step])
    proc.stdin.flush()
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 0
  return out.decode()


@pytest.mark.parametrize('chunks', [1, 7, 300])
def test_grappler_filter_drops_the_cycle_lines_and_notes_them_once(chunks):
  real = 'E0000 00:00:1.0 1 some_kernel.cc:1] a real error'
  lines = [_REMAPPER, 'error: kept', _DEPENDENCY, real, _DEPENDENCY]
  data = ('\n'.join(lines * 2) + '\nno newline at the end').encode()
  assert _GrapplerFiltered(data, chunks) == (
      _startup.GRAPPLER_NOTE + '\nerror: kept\n' + real + '\nerror: kept\n' +
      real + '\nno newline at the end')


def test_the_xla_caches_text_reads_are_dropped_without_a_note():
  read = ('E0000 00:00:1795937223.125424   13015 text_format.cc:378] Error '
          'parsing text-format tensorflow.XlaSerializedCacheEntry: 2:1: '
          'Expected identifier, got: 6')
  other = ('E0000 00:00:1.0 1 text_format.cc:378] Error parsing text-format '
           'tensorflow.GraphDef: 1:1: a user\'s file')
  assert _GrapplerFiltered('\n'.join(['step 1', read, other, read, 'step 2',
                                       '']).encode()) == (
                                           'step 1\n%s\nstep 2\n' % other)


def test_grappler_filter_passes_a_partial_line_on_at_once():
  proc = subprocess.Popen(
      [sys.executable, '-S', '-c', _startup._FILTER_PROGRAM,  # pylint: disable=protected-access
       _startup.GRAPPLER_NOTE, *_startup.GRAPPLER_CYCLES],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  try:
    proc.stdin.write(b'step 3/10 ')  # No newline yet: not held back.
    proc.stdin.flush()
    assert os.read(proc.stdout.fileno(), 100) == b'step 3/10 '
    proc.stdin.write(b'loss 1.0\n' + _REMAPPER.encode() + b'\n')
    proc.stdin.close()
    assert proc.stdout.read().decode() == (
        'loss 1.0\n' + _startup.GRAPPLER_NOTE + '\n')
  finally:
    proc.kill()
    proc.wait(10)


def test_grappler_filter_is_off_where_the_user_set_the_level(monkeypatch):
  monkeypatch.setenv(_startup.LEVEL_VAR, '1')
  monkeypatch.delenv(_startup._MARK, raising=False)  # pylint: disable=protected-access
  assert _startup.FilterHarmlessLines() is None


@pytest.mark.e2e
def test_trainer_under_zero_bubble_notes_grappler_once(tmp_path):
  # Under a list schedule Grappler logs its cycle lines at E level; the
  # trainer's console shows the note once and no such line, and the run's
  # last line (after os._exit or a normal end) still arrives.
  env = _Env()
  proc = subprocess.run(
      [sys.executable, '-m', 'lingvo_ext.trainer',
       '--model=lm.TransformerLmTinyGPipe', f'--logdir={tmp_path / "zb"}',
       '--max_steps=2', '--num_cpu_devices=2', '--worker_split_size=2',
       '--model_params_override=task.schedule:"zero_bubble"'],
      env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'step 2/2' in proc.stdout
  assert 'remapper failed' not in proc.stderr
  assert 'topological sort failed' not in proc.stderr
  assert proc.stderr.count(_startup.GRAPPLER_NOTE) == 1, proc.stderr


def test_importing_lingvo_ext_leaves_the_console_alone():
  # A library does not change its user's console: no filter, no logging
  # filter, no TF_CPP_MIN_LOG_LEVEL (the programs install them:
  # lingvo_ext/entry_point.py).
  code = ('import logging, os, sys, lingvo_ext\n'
          'from lingvo_ext import _startup\n'
          'assert _startup._FINDER not in sys.meta_path\n'
          'assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ\n'
          'for name in ("absl", "tensorflow"):\n'
          '  assert not any(isinstance(f, _startup.RepeatFilter)\n'
          '                 for f in logging.getLogger(name).filters), name\n'
          'from lingvo_ext import entry_point\n'
          'assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"\n'
          'assert _startup._FINDER in sys.meta_path\n'
          'print("ok")\n')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=_Env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout == 'ok\n', out.stderr[-2000:]


def _Programs():
  """lingvo_ext's modules that run as programs, and the console scripts'."""
  import glob  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  out = set()
  for path in glob.glob(os.path.join(ROOT, 'lingvo_ext', '**', '*.py'),
                        recursive=True):
    with open(path, encoding='utf-8') as f:
      if "if __name__ == '__main__':" in f.read():
        out.add(os.path.relpath(path, ROOT))
  with open(os.path.join(ROOT, 'pyproject.toml'), encoding='utf-8') as f:
    for module in re.findall(r'^[\w-]+ = "([\w.]+):\w+"$', f.read(), re.M):
      out.add(module.replace('.', '/') + '.py')
  return sorted(out)


def test_every_program_imports_entry_point_before_anything_else():
  import ast  # pylint: disable=g-import-not-at-top
  programs = _Programs()
  assert 'lingvo_ext/trainer.py' in programs and len(programs) >= 8, programs
  wrong = []
  for rel in programs:
    with open(os.path.join(ROOT, rel), encoding='utf-8') as f:
      tree = ast.parse(f.read(), rel)
    first = None
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module + '.' + a.name for a in node.names]
      else:
        continue
      names = [n for n in names
               if n.split('.')[0] not in sys.stdlib_module_names]
      if names:
        first = (node.lineno, names[0])
        break
    if first is None or first[1] != 'lingvo_ext.entry_point':
      wrong.append('%s: first import %s' % (rel, first))
  assert not wrong, '\n'.join(wrong)
