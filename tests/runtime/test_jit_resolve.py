"""XLA's 'auto' resolved before the build (runtime/jit_resolve.py): each
pipeline's jit_compile a bool in the params, cached or timed; the timing is
stubbed (no test asserts a time)."""

import json
import pickle
import threading

import lingvo.compat as tf
from lingvo.core import py_utils
import pytest

from lingvo_ext.runtime import jit_measure
from lingvo_ext.runtime import jit_resolve
from lingvo_ext.tasks import experiment_params
from tests.support import gpipe_testlib as lib
from tests.support import lingvo_lm_testlib


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  return tmp_path / 'lingvo_ext' / 'jit_compile.json'


def _Params(model='lm.TransformerLmTinyGPipe', overrides='task.jit_compile:'
            '"auto"'):
  return experiment_params.GetParams(model, 'Train', overrides, '',
                                     'lingvo_ext')


def _Stub(monkeypatch, ms):
  calls = []
  monkeypatch.setattr(jit_measure, 'Measure',
                      lambda *a: calls.append(a) or ms)
  return calls


def test_only_auto_is_resolved():
  assert jit_resolve.Autos(_Params(overrides='')) == []
  assert jit_resolve.Resolve(_Params(overrides='task.jit_compile:True'),
                             2) == []
  cfg = _Params()
  (path, holder, child), = jit_resolve.Autos(cfg)
  assert (path, holder, child) == ('task.jit_compile', cfg.task, 'pipeline')


def test_a_pipelined_task_gets_the_bool_its_build_then_takes(cache,
                                                             monkeypatch):
  calls = _Stub(monkeypatch, {True: 1.0, False: 2.0})
  cfg = _Params()
  decision, = jit_resolve.Resolve(cfg, 2, fresh_process=False)
  assert cfg.task.jit_compile is True and len(calls) == 1
  assert decision.Line().startswith(
      "jit_compile: True for task.jit_compile ('auto' took True: 1.0 ms per "
      'step with XLA, 2.0 without (measured now, cached in ')
  (entry,) = json.loads(cache.read_text()).values()
  assert entry['jit_compile'] is True
  # Again: the cached choice, no timing.
  cfg = _Params()
  decision, = jit_resolve.Resolve(cfg, 2, fresh_process=False)
  assert cfg.task.jit_compile is True and len(calls) == 1
  assert '(cached in ' in decision.Line()
  # An 'auto' left to the training build (2 devices) finds the same entry:
  # the captured inputs and params key it as the build does.
  cfg = _Params()
  with tf.Graph().as_default(), lib.Cluster(2):
    task, _, _ = lib.BuildTrainTask(cfg.task.Set(input=cfg.input))
  assert task.pipeline.JitCompile() is True and len(calls) == 1


def test_lingvos_stack_in_the_tree_is_resolved_on_its_own_path(
    cache, monkeypatch, tmp_path):
  lingvo_lm_testlib.Write(str(tmp_path))
  monkeypatch.syspath_prepend(str(tmp_path))
  _Stub(monkeypatch, {True: 2.0, False: 1.0})
  override = 'task.lm.stack.jit_compile:"auto"'
  cfg = _Params(lingvo_lm_testlib.UNTRIMMED_MODEL, override)
  decision, = jit_resolve.Resolve(cfg, 2, fresh_process=False)
  assert cfg.task.lm.stack.jit_compile is False
  assert decision.paths == ('task.lm.stack.jit_compile',)
  assert "'auto' took False: 2.0 ms per step with XLA, 1.0" in decision.Line()
  # Trimmed to each batch, the time axis is unknown: False, nothing timed.
  _Stub(monkeypatch, None)
  cfg = _Params(lingvo_lm_testlib.MODEL, override)
  decision, = jit_resolve.Resolve(cfg, 2, fresh_process=False)
  assert cfg.task.lm.stack.jit_compile is False
  assert "an input's shape is not known" in decision.Line()


def test_a_failed_timing_builds_without_xla(cache, monkeypatch):
  def Fail(*unused):
    raise RuntimeError('no devices\nmore')

  monkeypatch.setattr(jit_measure, 'Measure', Fail)
  cfg = _Params()
  decision, = jit_resolve.Resolve(cfg, 2, fresh_process=False)
  assert cfg.task.jit_compile is False
  assert decision.reason == "'auto' took False: the timing failed (no devices)"


def test_a_cached_choice_starts_no_process(cache, monkeypatch):
  _Stub(monkeypatch, {True: 2.0, False: 1.0})
  jit_resolve.Resolve(_Params(), 2, fresh_process=False)
  monkeypatch.setattr(jit_resolve, '_InFreshProcess',
                      lambda *a: pytest.fail('a process for a cached choice'))
  cfg = _Params()
  decision, = jit_resolve.Resolve(cfg, 2)
  assert cfg.task.jit_compile is False and '(cached in ' in decision.Line()


def test_the_timing_runs_in_a_fresh_process(cache):
  """The trainer's path on a cache miss: the pipeline's params and input
  shapes go to a fresh process, which times them (for real: no stub crosses
  the fork) and writes the cache; this process starts no thread."""
  from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
  from tests.core import test_gpipe  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default(), lib.Cluster(2):
    params = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=test_gpipe._FcCells(2),  # pylint: disable=protected-access
        num_micro_batches=2, jit_compile='auto').Instantiate().params
  specs = (tf.TensorSpec([8, 6], tf.float32),)
  threads = {t.name for t in threading.enumerate()}
  got = jit_resolve._InFreshProcess(  # pylint: disable=protected-access
      pickle.dumps(([('p', params, specs)], 2, False, False)), 600)
  assert {t.name for t in threading.enumerate()} <= threads
  (value, why), = got.values()
  assert why.startswith(f"'auto' took {value}: ") and 'measured now' in why
  (entry,) = json.loads(cache.read_text()).values()
  assert entry['jit_compile'] is value and entry['ms_tf'] > 0


def test_a_layer_built_directly_is_resolved_on_its_inputs(cache, monkeypatch):
  from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
  from tests.core import test_gpipe  # pylint: disable=g-import-not-at-top
  _Stub(monkeypatch, {True: 1.0, False: 2.0})
  p = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=test_gpipe._FcCells(2),  # pylint: disable=protected-access
      num_micro_batches=2, jit_compile='auto')
  decision = jit_resolve.ResolveLayer(
      p, lambda net: net.FPropDefaultTheta(tf.zeros([8, 6])), 2)
  assert p.jit_compile is True and decision.paths == ('pipe.jit_compile',)
  with tf.Graph().as_default(), lib.Cluster(2):  # 'auto' finds the entry.
    py_utils.GetOrCreateGlobalStepVar()
    net = p.Copy().Set(jit_compile='auto').Instantiate()
    net.FPropDefaultTheta(tf.zeros([8, 6]))
  assert net.JitCompile() is True


def test_an_eval_dataset_is_resolved_for_its_eval_build(cache, monkeypatch):
  import types  # pylint: disable=g-import-not-at-top
  calls = _Stub(monkeypatch, {True: 1.0, False: 2.0})
  cfg = _Params()
  one = types.SimpleNamespace(worker_split_size=1)
  assert jit_resolve.ForEvalDataset(one, cfg) == []  # Cells in turn.
  assert cfg.task.jit_compile == 'auto' and not calls
  decision, = jit_resolve.Resolve(cfg, 2, fresh_process=False, do_eval=True)
  assert cfg.task.jit_compile is True
  (do_eval,) = {a[2] for a in calls}
  assert do_eval is True and 'measured now' in decision.Line()
