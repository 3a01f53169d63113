"""Shared test set-up: the repository on sys.path, lingvo_ext imported.

Under pytest-xdist (scripts/test.sh), a session or module fixture runs once
per worker; SharedOnce builds an expensive one (a trainer run) once in all,
the other workers waiting on a file lock and reusing its result.
"""

import collections
import fcntl
import gc
import json
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# XLA's compiled cells (lingvo_ext/xla_cache.py) are kept in a folder of this
# run's, shared by its workers and the programs they start, not in ~/.cache:
# set before TensorFlow is imported, which reads the flag once. The pytest
# process that made it removes it at exit.
_XLA_OWNER = 'LINGVO_EXT_TEST_XLA_CACHE_OWNER'
if 'TF_XLA_FLAGS' not in os.environ:
  import atexit
  import tempfile
  _xla_dir = tempfile.mkdtemp(prefix='lingvo_ext_test_xla_')
  os.environ['TF_XLA_FLAGS'] = (
      '--tf_xla_persistent_cache_directory=' + _xla_dir)
  os.environ[_XLA_OWNER] = str(os.getpid())
  atexit.register(
      lambda: os.environ.get(_XLA_OWNER) == str(os.getpid()) and
      shutil.rmtree(_xla_dir, ignore_errors=True))
# pylint: disable=g-import-not-at-top
from lingvo_ext import entry_point  # pylint: disable=unused-import
from tests.support import ROOT as _ROOT
from tests.support import lingvo_lm_testlib
from tests.support import mt_testlib
from tests.support import zygote

# pylint: enable=g-import-not-at-top


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
    with open(state, 'w') as f:  # Absolute paths (older state files), if any.
      f.write(text.replace('"%s/' % self.logdir, '"%s/' % dst))
    return dst


def _SharedOnce(tmp_path_factory, name, build):
  """build(path)'s JSON result, built once for all pytest-xdist workers.

  A module fixture runs once per worker that gets one of its tests; an
  expensive one (a trainer run) goes through here instead: the first worker
  builds it under `name` in the run's shared temp folder while the others
  wait on a file lock, then read its result (the pattern pytest-xdist
  documents). build must leave `path` as the tests expect it, read-only.
  """
  # The parent of this worker's basetemp is shared by all workers of a run.
  # (Without pytest-xdist, -p no:xdist, the basetemp itself.)
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    shared = shared.parent
  path = str(shared / name)
  done = path + '.json'
  with open(path + '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
    if not os.path.exists(done):
      result = build(path)
      with open(done, 'w') as f:
        json.dump({'result': result}, f)
    with open(done) as f:
      return json.load(f)['result']


@pytest.fixture(scope='session', autouse=True)
def _jit_choice_cache(tmp_path_factory):
  """jit_compile='auto' caches its choices in the run's temp folder (shared
  by the workers and the programs they start), not in ~/.cache."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    shared = shared.parent
  os.environ['XDG_CACHE_HOME'] = str(shared / 'xdg_cache')
  _SeedMemoryConstants()


# The memory model's constants in the tests' cache: the suite's runs do not
# spend minutes probing this machine (tests/planner/test_memory_model.py
# tests the probe's cache; bench/memory.py measures the model against real
# runs with this machine's own).
TEST_MEMORY_CONSTANTS = dict(runtime_bytes=900 * 2**20,
                             activation_factor=1.25, bytes_per_op=12288.)


def _SeedMemoryConstants():
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  for n in range(1, 9):
    memory_probe.Seed(n, dict(TEST_MEMORY_CONSTANTS, probe='tests'))


@pytest.fixture(scope='session')
def shared_once(tmp_path_factory):
  """shared_once(name, build): build(path)'s result, once for all workers."""
  return lambda name, build: _SharedOnce(tmp_path_factory, name, build)


@pytest.fixture(scope='session')
def tiny_gpipe_run(shared_once):
  """lm.TransformerLmTinyGPipe, K=2 cells on 2 CPU devices under '1f1b', 3
  steps.

  Shared by the tests that need a finished pipelined run: the K=2 vs K=1
  loss, resuming across variable stacking, a damaged latest checkpoint,
  serving's export of a model trained pipelined under '1f1b' (a resumed run
  goes on under the default schedule: checkpoints do not depend on it).
  Tests only read it or continue in a copy (TrainedRun.Copy).
  """
  model = 'lm.TransformerLmTinyGPipe'
  flags = ['--num_cpu_devices=2', '--worker_split_size=2']

  def Build(logdir):
    # Checkpoints at steps 0 and 3 only, however slowly the steps run (the
    # experiment saves every 5 s).
    proc = zygote.run(
        [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={model}',
         f'--logdir={logdir}', '--max_steps=3', *flags,
         '--model_params_override=task.schedule:"1f1b";'
         'train.save_interval_seconds:3600'],
        cwd=_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return [logdir, proc.stdout]

  logdir, output = shared_once('tiny_gpipe_run', Build)
  return TrainedRun(logdir, model, flags, output)


@pytest.fixture(scope='session')
def lingvo_lm_run(shared_once):
  """Lingvo's own GPipe LM (tests/support/lingvo_lm_testlib.py), 2 cells on
  2 CPU devices under '1f1b' on lingvo_ext's engine, 2 steps.

  Shared by tests/tasks/test_lingvo_models.py (the checkpoint's names) and
  tests/serving/test_serving.py (its export). run.pythonpath is the folder
  of the experiment's module. Tests only read it or go on in a copy.
  """
  model = lingvo_lm_testlib.MODEL
  flags = ['--num_cpu_devices=2', '--worker_split_size=2',
           '--gpipe_engine=lingvo_ext',
           '--model_params_override=task.lm.stack.schedule:"1f1b"']

  def Build(path):
    exp = lingvo_lm_testlib.Write(os.path.join(path, 'exp'))
    logdir = os.path.join(path, 'logdir')
    proc = zygote.run(
        [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={model}',
         f'--logdir={logdir}', '--max_steps=2', *flags],
        cwd=_ROOT, env=dict(os.environ, PYTHONPATH=exp),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return [exp, logdir, proc.stdout]

  exp, logdir, output = shared_once('lingvo_lm_run', Build)
  run = TrainedRun(logdir, model, flags, output)
  run.pythonpath = exp
  return run


@pytest.fixture(scope='session')
def lingvo_mt_run(shared_once):
  """The GPipe NMT experiment (tests/support/mt_testlib.py's MODEL), 2 cells
  on 2 CPU devices, 3 steps, a checkpoint at step 3.

  Shared by the MT tests of the evaler, decoder, tools and export.
  run.pythonpath is the experiment's folder (its data under it). Tests only
  read it or go on in a copy (TrainedRun.Copy).
  """
  model = mt_testlib.MODEL
  flags = ['--num_cpu_devices=2', '--worker_split_size=2']

  def Build(path):
    exp = os.path.join(path, 'exp')
    mt_testlib.Write(exp)
    logdir = os.path.join(path, 'logdir')
    proc = zygote.run(
        [sys.executable, '-m', 'lingvo_ext.trainer', f'--model={model}',
         f'--logdir={logdir}', '--max_steps=3', *flags],
        cwd=_ROOT, env=mt_testlib.Env(exp),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return [exp, logdir, proc.stdout]

  exp, logdir, output = shared_once('lingvo_mt_run', Build)
  run = TrainedRun(logdir, model, flags, output)
  run.pythonpath = exp
  return run


# Seconds each test took in the runs before (pytest's cache, .pytest_cache),
# by test key (_Key): setup, call and teardown.
_TEST_SECONDS = 'lingvo_ext/test_seconds'
_seconds_now = collections.defaultdict(float)
# Without a time from before: an end-to-end test ~10 s, another ~1 s.
_DEFAULT_SECONDS = {True: 10.0, False: 1.0}


def _Key(nodeid):
  """The node id without the file's folder: a test keeps its time from the
  runs before when its file moves (file basenames are unique under tests/,
  tests/test_layout.py)."""
  path, sep, rest = nodeid.partition('::')
  return path.rsplit('/', 1)[-1] + sep + rest


# The seconds of a whole run kept in the repository (scripts/
# save_test_seconds.py writes it from the cache): a fresh clone, CI's, has no
# cache, and by the e2e marker alone its long tests not marked e2e sort last.
_SAVED_SECONDS = os.path.join(os.path.dirname(__file__), 'test_seconds.json')


def _SavedSeconds():
  try:
    with open(_SAVED_SECONDS) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _SecondsBefore(config):
  """{test key: seconds}: the cache's, else the repository's saved run's."""
  cache = getattr(config, 'cache', None)  # None with -p no:cacheprovider.
  before = cache.get(_TEST_SECONDS, {}) if cache else {}
  seconds = _SavedSeconds()
  seconds.update((_Key(k), v) for k, v in before.items())  # Older: node ids.
  return seconds


def pytest_collection_modifyitems(config, items):
  # Longest first, by the time each test took last time (else end-to-end
  # tests first): scripts/test.sh hands the workers one test at a time in
  # this order (--dist load --maxschedchunk 1), so the long tests start
  # early on whichever worker is free and the run ends with short ones on
  # every worker, not one worker still running a long queue. Every worker
  # sorts alike: they read the same cache.
  before = _SecondsBefore(config)

  def Seconds(item):
    e2e = item.get_closest_marker('e2e') is not None
    return before.get(_Key(item.nodeid), _DEFAULT_SECONDS[e2e])

  items.sort(key=lambda item: -Seconds(item))


def pytest_runtest_logreport(report):
  _seconds_now[_Key(report.nodeid)] += report.duration


def pytest_sessionfinish(session):
  config = session.config
  if (getattr(config, 'cache', None) and not hasattr(config, 'workerinput')
      and _seconds_now):
    seconds = _SecondsBefore(config)
    seconds.update(_seconds_now)
    config.cache.set(_TEST_SECONDS, seconds)


def pytest_collection_finish(session):
  # What is imported by now (TensorFlow, Lingvo, the test modules) stays for
  # the whole run: frozen (gc.freeze), it is no longer walked by every full
  # collection that building a test's graph sets off.
  del session
  gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  # After the test's fixtures are torn down: its garbage is collected, and
  # what outlives it (module fixtures, TF's caches) is frozen, so the next
  # tests' collections do not walk it again and again. A worker's oldest
  # generation otherwise holds every earlier test's survivors: gc took 8% of
  # the quick tier in one process (17.2 s of 205.8), 2.9 s with this. Under
  # pytest-xdist each worker runs a third of the tests: no gain measured.
  del item, nextitem
  gc.collect()
  gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
  # The process is about to exit: the interpreter's last collection would
  # walk every object the tests left behind (seconds, after hundreds of
  # graphs; pytest's own collections for unraisable exceptions ran before).
  del config
  gc.freeze()
