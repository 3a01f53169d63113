"""The private TensorFlow and Lingvo symbols of lingvo_ext/_internal, checked.

One test per symbol: after an upgrade, a failure names the symbol that moved
and the file that needs a change. Also: importing lingvo_ext.trainer leaves
Lingvo's flag defaults alone, and the optional modules it defers
(_internal/deferred.py) work when used.
"""

import subprocess
import sys

import lingvo.compat as tf
import numpy as np
import pytest

from lingvo_ext import _internal
from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext._internal import tf as internal_tf


def _Gone(symbol, error):
  return (f'{symbol} changed or is gone in this TensorFlow/Lingvo '
          f'({", ".join(_internal.VersionMismatches()) or "pinned versions"}):'
          f' {type(error).__name__}: {error}; update lingvo_ext/_internal.')


def _Check(symbol, fn):
  try:
    fn()
  except Exception as e:  # pylint: disable=broad-except
    pytest.fail(_Gone(symbol, e))


def testPinnedVersionsAreInstalled():
  assert not _internal.VersionMismatches(), (
      f'installed versions differ from lingvo_ext/_internal.PINNED: '
      f'{_internal.VersionMismatches()}; run tests/test_internal.py and '
      'update the pins.')


# --- TensorFlow ---------------------------------------------------------------


def testControlFlowV2Switch():

  def Check():
    with tf.Graph().as_default():
      with internal_tf.V1ControlFlow():
        out = tf.cond(tf.constant(True), lambda: tf.constant(1),
                      lambda: tf.constant(2))
      assert out.op.type == 'Merge', out.op.type
      out = tf.cond(tf.constant(True), lambda: tf.constant(1),
                    lambda: tf.constant(2))
      assert out.op.type != 'Merge', out.op.type

  _Check('control_flow_util.ENABLE_CONTROL_FLOW_V2', Check)


def testMatMulGrad():

  def Check():
    with tf.Graph().as_default():
      a, b = tf.ones([2, 3]), tf.ones([3, 4])
      c = tf.matmul(a, b)
      ga, gb = internal_tf.MatMulGrad(c.op, tf.ones([2, 4]))
      with tf.Session() as sess:
        ga, gb = sess.run([ga, gb])
    np.testing.assert_allclose(ga, np.full([2, 3], 4.0))
    np.testing.assert_allclose(gb, np.full([3, 4], 2.0))

  _Check('math_grad._MatMulGrad', Check)


def testIsMklEnabled():
  _Check('_pywrap_util_port.IsMklEnabled',
         lambda: isinstance(internal_tf.IsMklEnabled(), bool) or 1 / 0)


def testSaveableObject():

  def Check():
    with tf.Graph().as_default():
      t = tf.constant([1.0])
      spec = internal_tf.SaveSpec(t, '', 'x')
      obj = internal_tf.SaveableObject(t, [spec], 'x')
      assert obj.specs[0].name == 'x'

  _Check('saveable_object.SaveableObject/SaveSpec', Check)


def testCheckpointState():

  def Check():
    state = internal_tf.CheckpointState(model_checkpoint_path='ckpt-1')
    assert state.model_checkpoint_path == 'ckpt-1'

  _Check('checkpoint_state_pb2.CheckpointState', Check)


def testSaveSliceInfo():

  def Check():
    with tf.Graph().as_default():
      whole = tf.get_variable('w', [4, 2], initializer=tf.zeros_initializer())
      parts = tf.get_variable(
          'p', [4, 2], initializer=tf.zeros_initializer(),
          partitioner=tf.compat.v1.fixed_size_partitioner(2))
      assert internal_tf.SaveSliceInfo(whole) is None
      shard = list(parts)[0]
      assert internal_tf.SaveSliceInfo(shard).full_shape == [4, 2]

  _Check('Variable._save_slice_info', Check)


def testOpIdAndAddControlInput():

  def Check():
    with tf.Graph().as_default():
      a, b = tf.no_op(name='a'), tf.no_op(name='b')
      assert internal_tf.OpId(a) < internal_tf.OpId(b)
      internal_tf.AddControlInput(a, b)
      assert a.control_inputs == [b]

  _Check('Operation._id/_add_control_input', Check)


def testBatchMatMulV2Grad():

  def Check():
    with tf.Graph().as_default():
      x = tf.constant(np.ones([2, 3, 4], np.float32))
      w = tf.constant(np.ones([4, 5], np.float32))
      y = tf.matmul(x, w)
      assert y.op.type == 'BatchMatMulV2'
      dx, dw = internal_tf.BatchMatMulV2Grad(y.op, tf.ones_like(y))
      assert dx.shape == x.shape and dw.shape == w.shape

  _Check('math_grad._BatchMatMulV2', Check)


def testUpdateInput():

  def Check():
    with tf.Graph().as_default():
      a, b = tf.constant(1.0), tf.constant(2.0)
      c = tf.identity(a)
      internal_tf.UpdateInput(c.op, 0, b)
      assert list(c.op.inputs) == [b]
      with tf.Session() as sess:
        assert sess.run(c) == 2.0

  _Check('Operation._update_input', Check)


def testFunctionGraph():

  def Check():
    import tensorflow as tf2  # pylint: disable=g-import-not-at-top
    with tf.Graph().as_default():
      x = tf.constant([1.0, 2.0])
      y = tf2.function(lambda a: tf.gather(a, [1]), autograph=False)(x)
      body = internal_tf.FunctionGraph(y.op)
      assert 'GatherV2' in [op.type for op in body.get_operations()]
      assert len(body.inputs) == 1
      assert internal_tf.FunctionGraph(x.op) is None

  _Check('Graph._get_function', Check)


def testOpGradients():

  def Check():
    import tensorflow as tf2  # pylint: disable=g-import-not-at-top
    with tf.Graph().as_default():
      x, w = tf.constant([[1.0, 2.0]]), tf.constant([[3.0], [4.0]])
      # A function call with a float output the loss does not use: its
      # gradient is zeros, as tf.gradients gives.
      f = tf2.function(lambda a, b: (tf.matmul(a, b), a * 2.0),
                       autograph=False)
      y, unused = f(x, w)
      assert y.op is unused.op
      dy = tf.constant([[5.0]])
      got = internal_tf.OpGradients(y.op, [dy, None])
      want = tf.gradients(y, [x, w], grad_ys=dy)
      assert len(got) == len(y.op.inputs)
      assert got[0].shape == x.shape and got[1].shape == w.shape
      with tf.Session() as sess:
        for a, b in zip(sess.run(got), sess.run(want)):
          np.testing.assert_allclose(a, b)

  _Check('ops.get_gradient_function', Check)


def testCallsOptimizedOnce():

  def Check():
    import tensorflow as tf2  # pylint: disable=g-import-not-at-top
    f = tf2.function(lambda a: a * 2.0, autograph=False)
    with tf.Graph().as_default():
      x = tf.constant(1.0)
      with internal_tf.CallsOptimizedOnce():
        inside = f(x)
      outside = f(x)
      off = lambda t: tf.config_pb2.ConfigProto.FromString(t.op.get_attr(
          'config_proto')).graph_options.rewrite_options.disable_meta_optimizer
      assert off(inside) and not off(outside)
      with tf.Session() as sess:
        assert sess.run(inside) == 2.0

  _Check('eager context.function_call_options', Check)


def testLocalServerConfig():

  def Check():
    config = tf.compat.v1.ConfigProto()
    config.device_count['CPU'] = 3
    with internal_tf.LocalServerConfig(config):
      server = tf.distribute.Server.create_local_server()
    assert 'create_local_server' in vars(tf.distribute.Server)
    with tf.Session(server.target, config=config) as sess:
      cpus = [d for d in sess.list_devices() if d.device_type == 'CPU']
    assert len(cpus) == 3, cpus

  _Check('tf.distribute.Server.create_local_server', Check)


def testMakeCallable():

  def Check():
    with tf.Graph().as_default():
      v = tf.Variable(1.0)
      added = tf.identity(v.assign_add(1.0))
      doubled = tf.raw_ops.AssignAddVariableOp(resource=v.handle, value=v * 2)
      with tf.Session() as sess:
        sess.run(v.initializer)
        add = internal_tf.MakeCallable(sess, [added.name], [])
        assert [float(x) for x in add()] == [2.0]
        assert [float(x) for x in add()] == [3.0]
        assert internal_tf.MakeCallable(sess, [], [doubled.name])() == []
        assert sess.run(v) == 9.0

  _Check('Session._make_callable_from_options', Check)


def testFreezeSessionGraph():

  def Check():
    with tf.Graph().as_default() as g:
      v = tf.Variable([1.0, 2.0])
      ids = tf.placeholder(tf.int32, [None], name='ids')
      out = tf.while_loop(
          lambda i, x: i < 2, lambda i, x: (i + 1, x + v.read_value()),
          (0, tf.cast(ids, tf.float32)))[1]
      out = tf.identity(out, name='out')
      with tf.Session() as sess:
        sess.run(v.initializer)
        frozen = internal_tf.FreezeSessionGraph(sess, g.as_graph_def(),
                                                ['out'])
    assert not [n for n in frozen.node if n.op == 'VarHandleOp']
    with tf.Graph().as_default():
      tf.import_graph_def(frozen, name='')
      with tf.Session() as sess:
        np.testing.assert_allclose(sess.run('out:0', {'ids:0': [1, 0]}),
                                   [3.0, 4.0])

  _Check('convert_to_constants.convert_variables_to_constants_from_session_'
         'graph', Check)


def testSlurmClusterResolverModule():

  def Check():
    slurm = internal_tf.SlurmClusterResolverModule()
    assert slurm.expand_hostlist('n[1-2]') == ['n1', 'n2']
    assert slurm.expand_tasks_per_node('2(x2)') == [2, 2]
    assert slurm.SlurmClusterResolver

  _Check('slurm_cluster_resolver.expand_hostlist/expand_tasks_per_node', Check)


# --- Lingvo -------------------------------------------------------------------


def testRegisteredModelClasses():

  def Check():
    from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
    registry.ImportExperiments()
    assert 'lm.TransformerLmTiny' in internal_lingvo.RegisteredModelClasses()

  _Check('model_registry._ModelRegistryHelper._MODEL_PARAMS', Check)


def testRekeyRegisteredModels():

  def Check():
    from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
    registry.ImportExperiments()
    models = internal_lingvo.RegisteredModelClasses()
    # The bundled experiments are keyed as --model names them.
    assert not [k for k in models if k.startswith('lingvo_ext.experiments.')]
    models['some.pkg.mod.RekeyMe'] = models['lm.TransformerLmTiny']
    try:
      assert 'some.pkg.mod.RekeyMe' in models
      internal_lingvo.RekeyRegisteredModels('some.pkg')
      assert 'mod.RekeyMe' in models
      assert 'some.pkg.mod.RekeyMe' not in models
    finally:
      models.pop('mod.RekeyMe', None)
      models.pop('some.pkg.mod.RekeyMe', None)

  _Check('model_registry._ModelRegistryHelper._MODEL_PARAMS (rekey)', Check)


def testDatasetParamsAppliesNoFlagOverride():

  def Check():
    from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
    registry.ImportExperiments()
    cls = internal_lingvo.RegisteredModelClasses()['lm.TransformerLmTiny']
    flags = tf.flags.FLAGS
    if not flags.is_parsed():
      flags.mark_as_parsed()
    saved = flags.model_params_override
    flags.model_params_override = 'task.num_micro_batches:3'
    try:
      cfg = internal_lingvo.DatasetParams(cls(), 'Train')
    finally:
      flags.model_params_override = saved
    assert cfg.task.num_micro_batches != 3
    assert cfg.input is not None

  _Check('model_registry._ModelRegistryHelper.GetParamsFromModelParamsObject',
         Check)


def testSetModelImporter():

  def Check():
    from lingvo import model_imports  # pylint: disable=g-import-not-at-top
    saved = model_imports.ImportParams
    internal_lingvo.SetModelImporter(len)
    try:
      from lingvo import model_registry  # pylint: disable=g-import-not-at-top
      assert model_registry.model_imports.ImportParams is len
    finally:
      internal_lingvo.SetModelImporter(saved)

  _Check('model_imports.ImportParams', Check)


def testSaveableVariables():

  def Check():
    from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
    with tf.Graph().as_default():
      model = experiment_params.GetParams('lm.TransformerLmTiny',
                                          'Train').Instantiate()
      saved = internal_lingvo.SaveableVariables([model])
    assert 'global_step' in saved and len(saved) > 2, sorted(saved)

  _Check('checkpointer._GetSaveableVariablesDict', Check)


def testOutsideLayerStack():

  def Check():
    from lingvo.core import base_layer  # pylint: disable=g-import-not-at-top
    from lingvo.core import layers  # pylint: disable=g-import-not-at-top
    built = []

    class Outer(base_layer.BaseLayer):

      def __init__(self, params):
        super().__init__(params)
        with internal_lingvo.OutsideLayerStack(), tf.Graph().as_default():
          built.append(
              layers.IdentityLayer.Params().Set(name='thrown').Instantiate())

    with tf.Graph().as_default():
      outer = Outer.Params().Set(name='outer').Instantiate()
    assert built and not outer.children, outer.children

  _Check('base_layer._LAYER_STACK', Check)


def testPrivateVarsAndTheta():

  def Check():
    from lingvo.core import layers  # pylint: disable=g-import-not-at-top
    with tf.Graph().as_default():
      layer = layers.ProjectionLayer.Params().Set(
          name='p', input_dim=2, output_dim=3, batch_norm=False).Instantiate()
      assert 'w' in internal_lingvo.PrivateVars(layer)
      assert 'w' in internal_lingvo.PrivateTheta(layer)

  _Check('BaseLayer._private_vars/_private_theta', Check)


def testParamDefaultAndDescription():

  def Check():
    from lingvo.core import hyperparams  # pylint: disable=g-import-not-at-top
    p = hyperparams.Params()
    p.Define('x', 3, 'The x.')
    p.x = 5
    assert internal_lingvo.ParamDefault(p, 'x') == 3
    assert internal_lingvo.ParamDescription(p, 'x') == 'The x.'
    internal_lingvo.SetParamDescription(p, 'x', 'The new x.')
    assert internal_lingvo.ParamDescription(p, 'x') == 'The new x.'

  _Check('hyperparams.Params._params/_Param._description', Check)


def testEngineSymbols():

  def Check():
    from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
    assert isinstance(internal_lingvo.OVERWRITE_GLOBAL_STEP_COLLECTION, str)
    m = py_utils.NestedMap(a=1, b=py_utils.NestedMap(c=2))
    out = internal_lingvo.RecursiveMap(m, lambda k, v: (k, v))
    assert out.b.c == ('b.c', 2), out
    with internal_lingvo.StepSeedPairFn(len):
      assert py_utils.GenerateStepSeedPair is len
    assert py_utils.GenerateStepSeedPair is not len

  _Check('gpipe._OVERWRITE_GLOBAL_STEP_COLLECTION, NestedMap._RecursiveMap, '
         'py_utils.GenerateStepSeedPair', Check)


def testSeqCells():

  def Check():
    from lingvo.core import gpipe as lingvo_gpipe  # pylint: disable=g-import-not-at-top
    from lingvo.core import layers  # pylint: disable=g-import-not-at-top
    with tf.Graph().as_default():
      seq = lingvo_gpipe.SeqLayer.Params().Set(
          name='seq', cell_tpl=[
              layers.IdentityLayer.Params().Set(name='a'),
              layers.IdentityLayer.Params().Set(name='b')
          ]).Instantiate()
      cells = internal_lingvo.SeqCells(seq)
    assert [name for name, _ in cells] == ['a', 'b'], cells

  _Check('gpipe.SeqLayer._cells', Check)


def testInitTpuEmbeddingManager():

  def Check():
    from lingvo.core import tpu_embedding_layers_v2  # pylint: disable=g-import-not-at-top
    saved = tpu_embedding_layers_v2.TPU_EMBEDDING_MANAGER
    try:
      internal_lingvo.InitTpuEmbeddingManager()
      assert tpu_embedding_layers_v2.TPU_EMBEDDING_MANAGER is not None
    finally:
      tpu_embedding_layers_v2.TPU_EMBEDDING_MANAGER = saved

  _Check('tpu_embedding_layers_v2.TPU_EMBEDDING_MANAGER', Check)


# --- The trainer changes no default at import ------------------------------------


@pytest.mark.e2e
def testImportingTheTrainerKeepsLingvosFlagDefaults(tmp_path):
  code = ('import lingvo.compat as tf; from lingvo import trainer; '
          'F = tf.flags.FLAGS; names = ("run_locally", "mode", '
          '"stateless_vars_init", "use_custom_saver"); '
          'before = [F[n].default for n in names]; '
          'import lingvo_ext.trainer; '
          'print(before == [F[n].default for n in names], before)')
  import os  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, cwd=str(tmp_path), env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[0] == 'True', out.stdout


def testWriteRelativeStateFile(tmp_path):

  def Check():
    import glob  # pylint: disable=g-import-not-at-top
    import os  # pylint: disable=g-import-not-at-top
    import types  # pylint: disable=g-import-not-at-top
    from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
    from lingvo.core import saver as lingvo_saver  # pylint: disable=g-import-not-at-top
    for kind in ('lingvo', 'tf'):
      logdir = str(tmp_path / kind)
      os.makedirs(logdir)
      with tf.Graph().as_default(), tf.Session() as sess:
        step = py_utils.GetOrCreateGlobalStepVar()
        var = tf.get_variable('w', initializer=1.0)
        if kind == 'lingvo':
          inner = lingvo_saver.Saver(logdir, [step, var], keep_latest_n=2)
          save = lambda: inner.Save(sess)[1]
        else:
          inner = tf.train.Saver([step, var], max_to_keep=2)
          save = lambda: inner.save(sess, f'{logdir}/ckpt', sess.run(step))
        internal_lingvo.WriteRelativeStateFile(
            types.SimpleNamespace(_saver=types.SimpleNamespace(_saver=inner)))
        sess.run(tf.global_variables_initializer())
        for i in range(1, 5):
          sess.run([step.assign(i), var.assign(float(i))])
          name = f'ckpt-{i}' if kind == 'tf' else f'ckpt-{i:08d}'
          assert save() == f'{logdir}/{name}'
        with open(f'{logdir}/checkpoint') as f:
          text = f.read()
        assert logdir not in text and 'ckpt-' in text, text
        kept = sorted(glob.glob(f'{logdir}/ckpt-*.index'))
        assert len(kept) == 2, kept
        assert tf.train.latest_checkpoint(logdir) == kept[-1][:-len('.index')]
        sess.run(var.assign(0.0))
        if kind == 'lingvo':
          assert inner.Restore(sess)[0] == 4  # Through its _GetState.
        else:
          inner.restore(sess, tf.train.latest_checkpoint(logdir))
        assert sess.run(var) == 4.0

  _Check('saver.Saver._GetState/_SetState, tf.train.Saver.'
         '_save_relative_paths', Check)


# --- Deferred optional imports (_internal/deferred.py) ---------------------------

_DEFERRED_USE = r'''
import sys
import lingvo_ext.trainer
from lingvo_ext._internal import deferred
loaded = sorted(m for m in ('sklearn.base', 'scipy.stats._stats_py',
                            'keras.src.wrappers') if m in sys.modules)
print('loaded at import:', loaded)
print('deferred:', sorted(n for n in deferred.DEFERRED
                          if type(sys.modules.get(n)) is deferred.Deferred))
# Used for real: the digits data, Lingvo's sklearn and scipy metrics, Keras's
# scikit-learn wrappers.
from lingvo_ext.tasks.image import input_generator
images, labels = input_generator.LoadImages('')
print('digits:', images.shape[0], int(labels.max()))
from lingvo.core import metrics
auc = metrics.AUCMetric()
auc.Update([1, 0, 1, 0, 1], [0.9, 0.2, 0.4, 0.6, 0.7])
import sklearn.metrics
want = sklearn.metrics.roc_auc_score([1, 0, 1, 0, 1], [0.9, 0.2, 0.4, 0.6, 0.7])
print('auc:', auc.value == want, want)
corr = metrics.CorrelationMetric(mode='spearman')
corr.Update([1., 2., 3., 4.], [1., 3., 2., 4.])
import scipy.stats
print('corr:', corr.value == scipy.stats.spearmanr([1, 2, 3, 4], [1, 3, 2, 4])[0])
import keras
from sklearn import base
print('keras:', issubclass(keras.wrappers.SKLearnClassifier, base.BaseEstimator))
'''


@pytest.mark.e2e
def testDeferredModulesLoadWhenUsed(tmp_path):
  """Importing the trainer defers scikit-learn; using it loads the real one."""
  import os  # pylint: disable=g-import-not-at-top
  from lingvo_ext._internal import deferred  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, '-c', _DEFERRED_USE],
                       capture_output=True, text=True, cwd=str(tmp_path),
                       env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = dict(l.split(': ', 1) for l in out.stdout.splitlines() if ': ' in l)
  assert lines['loaded at import'] == '[]', out.stdout
  assert lines['deferred'] == str(sorted(deferred.DEFERRED)), out.stdout
  assert lines['digits'] == '1797 9', out.stdout
  assert lines['auc'].startswith('True'), out.stdout
  assert lines['corr'] == 'True', out.stdout
  assert lines['keras'] == 'True', out.stdout


def testDeferredModuleBindsNowAndLoadsOnFirstUse(tmp_path, monkeypatch):
  """`import` binds the placeholder; an attribute or submodule loads it."""
  from lingvo_ext._internal import deferred  # pylint: disable=g-import-not-at-top
  pkg = tmp_path / 'deferred_pkg'
  pkg.mkdir()
  (pkg / '__init__.py').write_text('import sys\nsys.loads.append(__name__)\n'
                                   'X = 1\n')
  (pkg / 'sub.py').write_text('import sys\nsys.loads.append(__name__)\nY = 2\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(sys, 'loads', [], raising=False)
  monkeypatch.setattr(deferred, 'DEFERRED', ('deferred_pkg',
                                             'deferred_pkg.nope'))
  monkeypatch.setattr(deferred, '_TOO_LATE', ())
  try:
    # Only what is installed is deferred.
    assert deferred.Install() == ['deferred_pkg']
    import deferred_pkg  # pylint: disable=g-import-not-at-top,import-error
    assert sys.loads == [] and isinstance(deferred_pkg, deferred.Deferred)
    assert deferred_pkg.X == 1 and sys.loads == ['deferred_pkg']
    from deferred_pkg import sub  # pylint: disable=g-import-not-at-top,import-error
    assert sub.Y == 2 and sys.loads == ['deferred_pkg', 'deferred_pkg.sub']
    assert sys.modules['deferred_pkg'].sub is sub
    with pytest.raises(AttributeError):
      _ = deferred_pkg.nothing
    # A submodule's import loads its deferred package first.
    del sys.modules['deferred_pkg'], sys.modules['deferred_pkg.sub']
    sys.loads.clear()
    assert deferred.Install() == ['deferred_pkg']
    import deferred_pkg.sub  # pylint: disable=g-import-not-at-top,import-error,redefined-outer-name
    assert sys.loads == ['deferred_pkg', 'deferred_pkg.sub']
  finally:
    for name in ('deferred_pkg', 'deferred_pkg.sub'):
      sys.modules.pop(name, None)


# The Lingvo internals the runtime depends on (_internal/lingvo_runtime.py).


def _LingvoObject(dotted):
  """The class or method named `lingvo.module.Class[.method]`."""
  import importlib  # pylint: disable=g-import-not-at-top
  parts = dotted.split('.')
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module('.'.join(parts[:i]))
    except ImportError:
      continue
    for name in parts[i:]:
      obj = getattr(obj, name)
    return obj
  raise ImportError(dotted)


def _SelfNames(cls, store_only=False):
  """Names `self.<name>` in the source of cls and its bases of the same kind."""
  import ast  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  import textwrap  # pylint: disable=g-import-not-at-top
  out = set()
  for c in (cls,) if store_only else cls.__mro__:
    if c is object:
      continue
    tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
    out |= {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == 'self'
            and (not store_only or isinstance(n.ctx, ast.Store))}
  return out


@pytest.mark.parametrize('owner,name,signature',
                         __import__('lingvo_ext._internal.lingvo_runtime',
                                    fromlist=['x']).OVERRIDES)
def testOverriddenLingvoMethod(owner, name, signature):
  import inspect  # pylint: disable=g-import-not-at-top
  symbol = f'{owner}.{name}'
  _Check(symbol, lambda: _LingvoObject(symbol))
  got = str(inspect.signature(_LingvoObject(symbol)))
  assert got == signature, _Gone(symbol, ValueError(
      f'signature {got}, the runtime overrides {signature}'))


def testUsedLingvoNamesExist():
  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  for owner, names in lingvo_runtime.USES.items():
    cls = _LingvoObject(owner)
    attrs = _SelfNames(cls)
    for name in names:
      assert hasattr(cls, name) or name in attrs, _Gone(
          f'{owner}.{name}', AttributeError('not a method or self attribute'))


def testCopiedLingvoSourcesAreTheOnesCopied():
  import hashlib  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  for symbol, digest in lingvo_runtime.COPIED.items():
    got = hashlib.sha256(
        inspect.getsource(_LingvoObject(symbol)).encode()).hexdigest()
    assert got == digest, _Gone(symbol, ValueError(
        'its source differs from the one the runtime copied (the comment '
        'in _internal/lingvo_runtime.py COPIED says where and what changed)'))


def testTheSharingControllerSetsWhatLingvosControllerInitSets():
  from lingvo import runners as lingvo_runners  # pylint: disable=g-import-not-at-top
  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import one_build  # pylint: disable=g-import-not-at-top
  import ast, inspect, textwrap  # pylint: disable=g-import-not-at-top,g-multiple-import
  tree = ast.parse(textwrap.dedent(
      inspect.getsource(lingvo_runners.Controller.__init__)))
  lingvos = {n.attr for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
             and isinstance(n.value, ast.Name) and n.value.id == 'self'}
  assert sorted(lingvos) == sorted(lingvo_runtime.CONTROLLER_INIT_SETS), _Gone(
      'lingvo.runners.Controller.__init__', ValueError(
          f'sets {sorted(lingvos)}; one_build.py sets '
          f'{sorted(lingvo_runtime.CONTROLLER_INIT_SETS)}'))
  ours = _SelfNames(one_build.SharedModelControllerMixin, store_only=True)
  assert set(lingvo_runtime.CONTROLLER_INIT_SETS) <= ours, (
      sorted(set(lingvo_runtime.CONTROLLER_INIT_SETS) - ours))


def testLingvosTrainerFetchesTheStepTheTrainerSessionRecognises():
  import inspect  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  source = re.sub(r'\s+', '', inspect.getsource(
      _LingvoObject(lingvo_runtime.TRAIN_STEP_IN)))
  for fetch in lingvo_runtime.TRAIN_STEP_FETCHES:
    assert fetch in source, _Gone(lingvo_runtime.TRAIN_STEP_IN, ValueError(
        f'no longer runs {fetch}: local_trainer._TrainerSession recognises '
        'the training step by it'))


def testTheRuntimeUsesNoUnlistedLingvoInternal():
  """Every private Lingvo name the runners override or use is listed."""
  import re  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  from lingvo_ext._internal import lingvo_runtime  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import local_controller, local_evaler, local_trainer, runners  # pylint: disable=g-import-not-at-top,g-multiple-import
  overridden = {n for _, n, _ in lingvo_runtime.OVERRIDES}
  listed = overridden | {n for ns in lingvo_runtime.USES.values() for n in ns}
  unlisted = []
  for final in (runners.RunnerManager, local_controller.LocalController,
                local_trainer.LocalTrainer, local_evaler.LocalEvaler,
                local_evaler.LocalDecoder):
    lingvos = [c for c in final.__mro__ if c.__module__.startswith('lingvo.')]
    theirs = set().union(*(_SelfNames(c, store_only=True) for c in lingvos))
    for c in final.__mro__:
      if not c.__module__.startswith('lingvo_ext'):
        continue
      for name in vars(c):
        if (name.startswith('_') and not name.startswith('__') and
            any(hasattr(l, name) for l in lingvos) and name not in overridden):
          unlisted.append(f'{c.__name__}.{name} (override)')
      for name in set(re.findall(r'self\.(_[A-Za-z]\w*)',
                                 inspect.getsource(c))):
        if (name not in listed and name not in vars(c) and
            (name in theirs or any(hasattr(l, name) for l in lingvos))):
          unlisted.append(f'{c.__name__} uses {name}')
  assert not unlisted, (
      'Lingvo internals not in _internal/lingvo_runtime.py: ' +
      ', '.join(sorted(set(unlisted))))


def testEagerModeExecutesEagerlyInAGraphModeProcess():
  # A fresh interpreter: eager execution off for the process, on inside.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ('import tensorflow as tf\n'
          'tf.compat.v1.disable_eager_execution()\n'
          'from lingvo_ext._internal import tf as internal_tf\n'
          'assert not tf.executing_eagerly()\n'
          'with internal_tf.EagerMode():\n'
          '  assert tf.executing_eagerly()\n'
          '  assert float(tf.constant(2.0) * 3) == 6.0\n'
          'assert not tf.executing_eagerly()\n'
          'print("ok")\n')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0 and out.stdout == 'ok\n', out.stderr[-2000:]


def testOverridesTimeAxisTrimSeesASubclassesOwnTrim():
  from lingvo.tasks.lm import model as lm_model  # pylint: disable=g-import-not-at-top
  from lingvo_ext._internal import lingvo as internal_lingvo  # pylint: disable=g-import-not-at-top

  class Kept(lm_model.BatchMajorLanguageModel):

    def _TrimIfPossible(self, ids, paddings, labels, weights):
      return ids, paddings, labels, weights

  class Plain(lm_model.BatchMajorLanguageModel):
    pass

  assert internal_lingvo.OverridesTimeAxisTrim(Kept)
  assert not internal_lingvo.OverridesTimeAxisTrim(Plain)
  assert not internal_lingvo.OverridesTimeAxisTrim(
      lm_model.BatchMajorLanguageModel)

