"""jit_compile='auto': the faster build, timed once and cached."""

import json
import threading
import time

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.core import jit_choice
from tests.support import gpipe_testlib as lib
from tests.support import host_copy
from tests.core import test_gpipe

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


def test_auto_measures_once_then_takes_the_cached_choice(cache, monkeypatch):
  measured = []
  measure = jit_choice.Measure

  def Measure(*args):
    measured.append(measure(*args))
    return measured[-1]

  monkeypatch.setattr(jit_choice, 'Measure', Measure)
  _, net, _ = _Build('auto')
  (entry,) = json.loads(cache.read_text()).values()
  assert len(measured) == 1 and set(measured[0]) == {False, True}
  assert entry['jit_compile'] == (
      measured[0][True] <= jit_choice.XLA_MARGIN * measured[0][False])
  assert net.JitCompile() is entry['jit_compile']
  assert entry['ms_xla'] > 0 and entry['ms_tf'] > 0

  # Rebuilt, the model takes the cached choice, whichever it is.
  for choice in (True, False):
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: dict(entry, jit_compile=choice)}))
    _, net, _ = _Build('auto')
    assert net.JitCompile() is choice
  assert len(measured) == 1
  # Other input shapes are another model: measured again.
  _Build('auto', batch=2 * B)
  assert len(measured) == 2 and len(json.loads(cache.read_text())) == 2


def test_models_built_at_once_are_measured_once(cache, monkeypatch):
  """Processes (here threads, each with its own open lock file) building the
  same model at once: one measures, the others wait and read its entry."""
  calls = []

  def SlowMeasure(*unused_args):
    calls.append(1)
    time.sleep(1.)
    return {True: 1.0, False: 2.0}

  monkeypatch.setattr(jit_choice, 'Measure', SlowMeasure)
  taken = []
  threads = [threading.Thread(target=lambda: taken.append(
      _Build('auto')[1].JitCompile())) for _ in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert taken == [True] * 3 and len(calls) == 1


def test_auto_times_a_subclass_with_its_own_fprop(cache):
  """Lingvo's GPipeTransformerStack (its embedding, softmax and paddings
  around the pipeline): 'auto' times the pipeline on the inputs the
  pipeline took, whichever the subclass's FProp takes."""
  from tests.pipeline import test_loss_in_last_cell as stack_lib  # pylint: disable=g-import-not-at-top
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = stack_lib._Params('unrolled', False, layers=2, micro=2).Set(  # pylint: disable=protected-access
        jit_compile='auto').Instantiate()
    t, b = 4, 8
    ids = tf.zeros([t, b], tf.int32)
    net.FPropDefaultTheta(ids, tf.zeros([t, b]), labels=ids,
                          label_weights=tf.ones([t, b]))
  (entry,) = json.loads(cache.read_text()).values()
  assert net.JitCompile() is entry['jit_compile']
  assert entry['ms_xla'] > 0 and entry['ms_tf'] > 0


def test_auto_takes_no_xla_for_a_shape_unknown_at_build(cache, monkeypatch):
  """A time axis trimmed per batch (Lingvo's LM off TPU): nothing to time,
  and XLA would compile per length."""
  from tests.pipeline import test_loss_in_last_cell as stack_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jit_choice, 'Measure', lambda *a: pytest.fail('timed'))
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    net = stack_lib._Params('unrolled', False, layers=2, micro=2).Set(  # pylint: disable=protected-access
        jit_compile='auto').Instantiate()
    ids = tf.placeholder(tf.int32, [None, 8])
    net.FPropDefaultTheta(ids, tf.zeros_like(ids, tf.float32), labels=ids,
                          label_weights=tf.ones_like(ids, tf.float32))
  assert net.JitCompile() is False and not cache.exists()


@pytest.mark.parametrize('choice', [True, False])
def test_auto_computes_what_the_build_it_takes_computes(cache, monkeypatch,
                                                        choice):
  # The timing is stubbed to pick `choice`; the numbers are real.
  monkeypatch.setattr(jit_choice, 'Measure', lambda *a: {
      choice: 1.0, not choice: 2.0})
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


@pytest.mark.parametrize('ms_xla,taken', [(0.97, False), (0.95, True),
                                          (0.5, True), (1.2, False)])
def test_auto_takes_xla_only_when_clearly_faster(cache, monkeypatch, ms_xla,
                                                  taken):
  # Each process compiles XLA's cells again; a near tie is timing noise.
  monkeypatch.setattr(jit_choice, 'Measure', lambda *a: {
      True: ms_xla, False: 1.0})
  _, net, _ = _Build('auto')
  assert net.JitCompile() is taken
  [entry] = json.loads(cache.read_text()).values()
  assert (entry['jit_compile'], entry['ms_xla']) == (taken, ms_xla)


def test_auto_takes_no_xla_where_xla_cannot_compile_a_cell(cache):
  g = tf.Graph()
  with g.as_default(), lib.Cluster(2):
    py_utils.GetOrCreateGlobalStepVar()
    cells = test_gpipe._FcCells(2)  # pylint: disable=protected-access
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', num_micro_batches=2, jit_compile='auto',
        cell_tpl=[host_copy.HostCopy.Params().Set(name='host_copy')] + cells
    ).Instantiate()
    x = tf.constant(np.ones([B, D], np.float32))
    out = net.FPropDefaultTheta(x)
    init = tf.global_variables_initializer()
  assert net.JitCompile() is False
  [entry] = json.loads(cache.read_text()).values()
  assert entry['jit_compile'] is False and entry['ms_xla'] is None
  assert entry['ms_tf'] > 0
  assert entry['xla_error'].startswith(
      'Detected unsupported operations when trying to compile'), entry
  assert 'PyFunc' in entry['xla_error']
  with lib.Session(g, 2) as sess:  # The build taken runs.
    sess.run(init)
    assert sess.run(out).shape == (B, D)
