"""jit_compile='auto': the faster build, timed before the build and cached;
the layer's FProp never measures."""

import json
import threading
import time

import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext import cache_files
from lingvo_ext.core import gpipe
from lingvo_ext.core import jit_choice
from lingvo_ext.runtime import jit_measure
from tests.core import test_gpipe
from tests.support import gpipe_testlib as lib
from tests.support import host_copy

B, D = 8, 6


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  return tmp_path / 'lingvo_ext' / 'jit_compile.json'


def _Build(jit, batch=B):
  """(graph, layer, output) of a 2-cell FC pipeline on 2 devices."""
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=test_gpipe._FcCells(2),  # pylint: disable=protected-access
        num_micro_batches=2, jit_compile=jit).Instantiate()
    x = tf.constant(np.random.RandomState(0).randn(batch, D).astype(
        np.float32))
    out = net.FPropDefaultTheta(x)
  return g, net, out


@pytest.mark.parametrize('value', ['yes', 1, 'none'])
def test_a_bad_value_names_the_param(value):
  with tf.Graph().as_default(), lib.Cluster(2):
    with pytest.raises(ValueError, match=r"pipe: jit_compile=.*'auto'"):
      gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=test_gpipe._FcCells(2),  # pylint: disable=protected-access
          jit_compile=value).Instantiate()


def _Spec(batch=B):
  """The FC pipeline's input, as the runtime captures it."""
  return (tf.TensorSpec([batch, D], tf.float32),)


def _Params():
  with tf.Graph().as_default(), lib.Cluster(2):
    return gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=test_gpipe._FcCells(2),  # pylint: disable=protected-access
        num_micro_batches=2, jit_compile='auto').Instantiate().params


def _Resolve(ms, batch=B):
  """The runtime's measurement of the FC pipeline, with `ms` as the timing's
  result: (cache entry, how)."""
  return jit_measure.CachedOrMeasured(
      _Params(), _Spec(batch), False, 2, gpipe.PipeliningLayer.FProp,
      measure=lambda *a: ms)


def _NoMeasuring(monkeypatch):
  fail = lambda *a, **k: pytest.fail('measured while building')
  monkeypatch.setattr(jit_measure, 'Measure', fail)
  monkeypatch.setattr(jit_measure, '_Build', fail)
  monkeypatch.setattr(cache_files, 'Lock', fail)


def test_fprop_with_auto_measures_nothing(cache, monkeypatch):
  """Unresolved at FProp (a library user building the layer) and not
  cached: built without XLA; no timing, lock, thread or session."""
  _NoMeasuring(monkeypatch)
  sessions = []
  monkeypatch.setattr(tf, 'Session', lambda *a, **k: sessions.append(1))
  notes = []
  monkeypatch.setattr(tf.logging, 'log_first_n',
                      lambda level, msg, n, *args: notes.append(msg % args))
  threads = threading.active_count()
  _, net, _ = _Build('auto')
  assert net.JitCompile() is False
  assert threading.active_count() == threads and not sessions
  assert not cache.exists()
  # It says how 'auto' is chosen.
  (note,) = notes
  assert note.startswith("pipe: jit_compile='auto' has no cached choice")
  assert 'lingvo_ext.trainer' in note and 'jit_resolve.Resolve' in note


def test_fprop_takes_the_cached_choice(cache, monkeypatch):
  for choice in (True, False):
    entry, how = _Resolve({choice: 1.0, not choice: 2.0})
    assert how == 'measured now, cached in' and entry['jit_compile'] is choice
    with monkeypatch.context() as m:
      _NoMeasuring(m)
      _, net, _ = _Build('auto')
    assert net.JitCompile() is choice
    cache.unlink()
  # Other input shapes are another model: not in the cache.
  _Resolve({True: 1.0, False: 2.0})
  _, net, _ = _Build('auto', batch=2 * B)
  assert net.JitCompile() is False


def test_the_runtime_measures_once_then_reads_the_cache(cache):
  measured = []

  def Measure(*args):
    measured.append(jit_measure.Measure(*args))
    return measured[-1]

  spec = _Spec()
  entry, how = jit_measure.CachedOrMeasured(
      _Params(), spec, False, 2, gpipe.PipeliningLayer.FProp, Measure)
  assert len(measured) == 1 and set(measured[0]) == {False, True}
  assert entry['jit_compile'] == (
      measured[0][True] <= jit_choice.XLA_MARGIN * measured[0][False])
  assert entry['ms_xla'] > 0 and entry['ms_tf'] > 0
  again, how = jit_measure.CachedOrMeasured(
      _Params(), spec, False, 2, gpipe.PipeliningLayer.FProp, Measure)
  assert (again, how, len(measured)) == (entry, 'cached in', 1)


def test_models_measured_at_once_are_measured_once(cache):
  """Processes (here threads, each with its own open lock file) measuring
  the same model at once: one measures, the others wait and read its
  entry."""
  calls = []

  def SlowMeasure(*unused_args):
    calls.append(1)
    time.sleep(1.)
    return {True: 1.0, False: 2.0}

  params = _Params()
  taken = []
  threads = [threading.Thread(target=lambda: taken.append(
      jit_measure.CachedOrMeasured(params, _Spec(), False, 2,
                                   gpipe.PipeliningLayer.FProp,
                                   SlowMeasure)[0]['jit_compile']))
             for _ in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert taken == [True] * 3 and len(calls) == 1


def test_a_subclass_is_timed_on_the_inputs_its_pipeline_took(cache):
  """Lingvo's GPipeTransformerStack (its embedding, softmax and paddings
  around the pipeline): the runtime times the pipeline on the inputs the
  pipeline's capture hook saw, whichever the subclass's FProp takes."""
  from tests.pipeline import test_loss_in_last_cell as stack_lib  # pylint: disable=g-import-not-at-top
  got = []
  t, b = 4, 8
  evaler = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=1, split_size=1, do_eval=True)
  with tf.Graph().as_default(), evaler:
    py_utils.GetOrCreateGlobalStepVar()
    net = stack_lib._Params('unrolled', False, layers=2, micro=2).Set(  # pylint: disable=protected-access
        jit_compile='auto').Instantiate()
    net.AddCaptureHook(lambda theta, args: got.append(args))
    ids = tf.zeros([t, b], tf.int32)
    net.FPropDefaultTheta(ids, tf.zeros([t, b]), labels=ids,
                          label_weights=tf.ones([t, b]))
    specs = tf.nest.map_structure(
        lambda x: None if x is None else tf.TensorSpec(x.shape, x.dtype),
        got[0])
  entry, _ = jit_measure.CachedOrMeasured(
      net.params, specs, False, 2, gpipe.PipeliningLayer.FProp)
  assert entry['ms_xla'] > 0 and entry['ms_tf'] > 0
  with tf.Graph().as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = stack_lib._Params('unrolled', False, layers=2, micro=2).Set(  # pylint: disable=protected-access
        jit_compile='auto').Instantiate()
    ids = tf.zeros([t, b], tf.int32)
    net.FPropDefaultTheta(ids, tf.zeros([t, b]), labels=ids,
                          label_weights=tf.ones([t, b]))
  assert net.JitCompile() is entry['jit_compile']  # The same key.


def test_auto_takes_no_xla_for_a_shape_unknown_at_build(cache, monkeypatch):
  """A time axis trimmed per batch (Lingvo's LM off TPU): nothing to time,
  and XLA would compile per length."""
  from tests.pipeline import test_loss_in_last_cell as stack_lib  # pylint: disable=g-import-not-at-top
  _NoMeasuring(monkeypatch)
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = stack_lib._Params('unrolled', False, layers=2, micro=2).Set(  # pylint: disable=protected-access
        jit_compile='auto').Instantiate()
    ids = tf.placeholder(tf.int32, [None, 8])
    net.FPropDefaultTheta(ids, tf.zeros_like(ids, tf.float32), labels=ids,
                          label_weights=tf.ones_like(ids, tf.float32))
  assert net.JitCompile() is False and not cache.exists()
  why = jit_choice.Unmeasurable(net.params, [ids])
  assert why.startswith("an input's shape is not known"), why


@pytest.mark.parametrize('choice', [True, False])
def test_auto_computes_what_the_build_it_takes_computes(cache, choice):
  # The timing is stubbed to pick `choice`; the numbers are real.
  _Resolve({choice: 1.0, not choice: 2.0})
  outs = []
  for jit in ('auto', choice):
    g, net, out = _Build(jit)
    with g.as_default():
      init = tf.global_variables_initializer()
    with lib.Session(g, 2) as sess:
      sess.run(init)
      outs.append(sess.run(out))
    assert net.JitCompile() is choice
  np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize('ms_xla,taken', [(0.97, False), (0.95, True),
                                          (0.5, True), (1.2, False)])
def test_auto_takes_xla_only_when_clearly_faster(cache, ms_xla, taken):
  # Each process compiles XLA's cells again; a near tie is timing noise.
  entry, _ = _Resolve({True: ms_xla, False: 1.0})
  assert (entry['jit_compile'], entry['ms_xla']) == (taken, ms_xla)
  [stored] = json.loads(cache.read_text()).values()
  assert stored == entry
  _, net, _ = _Build('auto')
  assert net.JitCompile() is taken


def test_auto_takes_no_xla_where_xla_cannot_compile_a_cell(cache):
  cells = test_gpipe._FcCells(2)  # pylint: disable=protected-access
  p = gpipe.PipeliningLayer.Params().Set(
      name='pipe', num_micro_batches=2, jit_compile='auto',
      cell_tpl=[host_copy.HostCopy.Params().Set(name='host_copy')] + cells)
  with tf.Graph().as_default(), lib.Cluster(2):
    params = p.Copy().Instantiate().params
  entry, _ = jit_measure.CachedOrMeasured(params, _Spec(), False, 2,
                                          gpipe.PipeliningLayer.FProp)
  assert entry['jit_compile'] is False and entry['ms_xla'] is None
  assert entry['ms_tf'] > 0
  assert entry['xla_error'].startswith(
      'Detected unsupported operations when trying to compile'), entry
  assert 'PyFunc' in entry['xla_error']
  assert 'XLA cannot compile the cells' in jit_choice.Describe(entry, 'x')
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = p.Instantiate()
    x = tf.constant(np.ones([B, D], np.float32))
    out = net.FPropDefaultTheta(x)
    init = tf.global_variables_initializer()
  assert net.JitCompile() is False
  with lib.Session(g, 2) as sess:  # The build taken runs.
    sess.run(init)
    assert sess.run(out).shape == (B, D)


# --- The planner's dimension --------------------------------------------------


def test_plans_carry_jit_compile_into_the_experiment():
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top

  # pylint: disable-next=g-import-not-at-top
  from tests.support import planner_testlib
  profile = planner_testlib.Profile()
  default = planner.Enumerate(profile, 2, schedules=('unrolled',))
  both = planner.Enumerate(profile, 2, schedules=('unrolled',),
                           jit_choices=(False, True))
  assert {p.jit_compile for p in default} == {'auto'}
  assert len(both) == 2 * len(default)
  keys = [p.Key() for p in both]
  assert len(set(keys)) == len(keys) and keys[1].endswith(' xla')
  assert 'task.jit_compile' not in planner.Overrides(default[0])
  assert 'task.jit_compile:True' in planner.OverrideString(both[1])
  # A plan written before the dimension existed reads as 'auto'.
  old = default[0].ToDict()
  del old['jit_compile']
  assert planner.PlanFromDict(old) == default[0]


def test_task_default_is_unset_and_an_override_takes_each_value():
  from lingvo.core import hyperparams  # pylint: disable=g-import-not-at-top

  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipelined_task  # pylint: disable=g-import-not-at-top
  assert pipelined_task.PipelinedTask.Params().jit_compile is None
  for text, value in (('"auto"', 'auto'), ('auto', 'auto'), ('True', True),
                      ('False', False), ('None', None)):
    mp = hyperparams.Params()
    mp.Define('task', pipelined_task.PipelinedTask.Params(), '')
    experiment_params.ApplyOverrides(mp, 'task.jit_compile:' + text)
    assert mp.task.jit_compile == value, text
  mp = hyperparams.Params()
  mp.Define('task', pipelined_task.PipelinedTask.Params(), '')
  with pytest.raises(experiment_params.OverrideError,
                     match="True or False or 'auto'"):
    experiment_params.ApplyOverrides(mp, 'task.jit_compile:maybe')
