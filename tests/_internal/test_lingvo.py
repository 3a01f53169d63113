"""The private Lingvo symbols of lingvo_ext/_internal/lingvo.py, checked.

One test per symbol: after an upgrade, a failure names the symbol that moved
and the file that needs a change. Also: importing lingvo_ext.trainer leaves
Lingvo's flag defaults alone."""

import subprocess
import sys

import lingvo.compat as tf
import pytest

from lingvo_ext._internal import lingvo as internal_lingvo
from tests.support.internal_testlib import Check as _Check

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
    assert not [k for k in models if k.startswith('params.')]
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


def testNameSavesFromSnapshotNamesACheckpointByTheStepItHolds(tmp_path):
  """A training step between the async saver's copy of the variables and its
  read of the step: the checkpoint is named by the copied step."""

  def Check():
    import glob  # pylint: disable=g-import-not-at-top
    import os  # pylint: disable=g-import-not-at-top
    import types  # pylint: disable=g-import-not-at-top

    from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
    from lingvo.core import saver as lingvo_saver  # pylint: disable=g-import-not-at-top
    for fixed in (False, True):
      logdir = str(tmp_path / f'fixed_{fixed}')
      os.makedirs(logdir)
      with tf.Graph().as_default(), tf.Session() as sess:
        step = py_utils.GetOrCreateGlobalStepVar()
        var = tf.get_variable('w', initializer=0.0)
        train = tf.group(step.assign_add(1), var.assign_add(1.0))
        inner = lingvo_saver.Saver(logdir, [step, var], async_save=True)
        if fixed:
          internal_lingvo.NameSavesFromSnapshot(types.SimpleNamespace(
              _saver=types.SimpleNamespace(_saver=inner)))
        sess.run(tf.global_variables_initializer())

        class _StepsAfterTheCopy:

          def run(self, fetches, feed_dict=None):  # pylint: disable=invalid-name
            out = sess.run(fetches, feed_dict)
            if fetches is inner._copying_op:  # pylint: disable=protected-access
              sess.run(train)  # The trainer steps meanwhile.
            return out

        for _ in range(3):
          inner.Save(_StepsAfterTheCopy())
          inner.Sync()
        names = {}
        for index in sorted(glob.glob(f'{logdir}/ckpt-*.index')):
          prefix = index[:-len('.index')]
          names[int(prefix.rsplit('-', 1)[1])] = (
              int(tf.train.load_variable(prefix, 'global_step')),
              float(tf.train.load_variable(prefix, 'w')))
      if fixed:
        assert names == {0: (0, 0.0), 1: (1, 1.0), 2: (2, 2.0)}, names
      else:  # Lingvo's own: each named one step past what it holds.
        assert names == {1: (0, 0.0), 2: (1, 1.0), 3: (2, 2.0)}, names

  _Check('saver.Saver._save_op/_save_prefix/_save_global_step/_copied_vars/'
         '_AddShardedSaveOps', Check)
