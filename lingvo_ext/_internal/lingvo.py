"""Lingvo internals lingvo_ext needs, each behind one small function.

Each has a test in tests/_internal/. Lingvo's documented extension
points (BaseRunner._CreateCheckpointer, RunnerManager.model_registry, Learner
subclasses, task hooks) are used where they exist; these are the rest. The
internals the runtime's runner subclasses depend on are in lingvo_runtime.py.
"""

import contextlib
import importlib.util
import os
import sys

from lingvo import compat as tf
from lingvo import model_imports
from lingvo import model_registry
from lingvo.core import base_layer
from lingvo.core import checkpointer
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import saver as lingvo_saver


def RegisteredModelClasses():
  """{name: params class} of the registered models, importing nothing.

  model_registry.GetAllRegisteredClasses() first imports all of
  lingvo.tasks' params (a line each on stderr).
  """
  return model_registry._ModelRegistryHelper._MODEL_PARAMS  # pylint: disable=protected-access


def RekeyRegisteredModels(package):
  """Keys the models registered from `package`'s modules without its prefix.

  Lingvo keys a model by its module path less 'lingvo.tasks.' and 'params.';
  `package.lm.X` becomes `lm.X`, as --model names it.
  """
  registered = RegisteredModelClasses()
  prefix = package + '.'
  for key in [k for k in registered if k.startswith(prefix)]:
    registered[key[len(prefix):]] = registered.pop(key)


class _NoFlagOverrides(model_registry._ModelRegistryHelper):  # pylint: disable=protected-access
  """Lingvo's registry helper without applying --model_params_override."""

  @classmethod
  def MaybeUpdateParamsFromFlags(cls, cfg):
    del cfg  # The caller applies its overrides (lingvo_ext.registry).


def DatasetParams(model_params_obj, dataset_name):
  """Lingvo's params of a model object for a dataset, without flag overrides.

  The model's Model() with the dataset's input and its Task_<dataset> params,
  as model_registry.GetParams builds them.
  """
  return _NoFlagOverrides.GetParamsFromModelParamsObject(
      model_params_obj, dataset_name)


def SetModelImporter(import_params):
  """Points Lingvo's model_registry.Get* lookups at `import_params`.

  Lingvo's model_imports.ImportParams tries six modules under lingvo.tasks
  for each name, printing a line each, and cannot find the bundled
  experiments (keyed `lm.X`, module `params.lm`). For code
  that calls model_registry.GetParams directly after `import
  params`; the trainer and
  the tools use lingvo_ext.registry instead.
  """
  model_imports.ImportParams = import_params


def SaveableVariables(models):
  """{checkpoint key: variable} that Lingvo's Checkpointer saves for models."""
  return checkpointer._GetSaveableVariablesDict(models)  # pylint: disable=protected-access


@contextlib.contextmanager
def OutsideLayerStack():
  """Layers built inside are not recorded as children of one being built.

  Lingvo records every layer built during another's __init__ as that one's
  child; throw-away layers (cost measurements) are built with the stack of
  layers under construction set aside.
  """
  stack = base_layer._LAYER_STACK  # pylint: disable=protected-access
  saved = stack.stack
  stack.stack = []
  try:
    yield
  finally:
    stack.stack = saved


def PrivateVars(layer):
  """The layer's own {name: variable} (BaseLayer._private_vars), mutable."""
  return layer._private_vars  # pylint: disable=protected-access


def PrivateTheta(layer):
  """The layer's own {name: theta} (BaseLayer._private_theta), mutable."""
  return layer._private_theta  # pylint: disable=protected-access


def ParamDefault(params, name):
  """The default value of param `name` of `params` (not its current one)."""
  return params._params[name].GetDefault()  # pylint: disable=protected-access


def ParamDescription(params, name):
  """The description `name` was defined with."""
  return params._params[name]._description  # pylint: disable=protected-access


def SetParamDescription(params, name, description):
  """Replaces the description of an inherited param (Params has no setter)."""
  params._params[name]._description = description  # pylint: disable=protected-access


def InitTpuEmbeddingManager():
  """What lingvo.trainer.main does before its runners: a process-wide manager.

  Lingvo's Learner.Apply reads tpu_embedding_layers_v2.TPU_EMBEDDING_MANAGER
  (a module global that its trainer's main sets).
  """
  from lingvo.core import tpu_embedding_layers_v2  # pylint: disable=g-import-not-at-top
  from lingvo.core import tpu_embedding_manager  # pylint: disable=g-import-not-at-top
  tpu_embedding_layers_v2.TPU_EMBEDDING_MANAGER = (
      tpu_embedding_manager.TPUEmbeddingManager())


def SeqCells(layer):
  """[(name, cell)] of a lingvo.core.gpipe.SeqLayer (or a subclass: lingvo_ext's
  SeqLayer and PipeliningLayer keep the same attribute)."""
  return list(layer._cells)  # pylint: disable=protected-access


# For the pipeline engine (pipeline/schedules.py, core/gpipe.py).

# The collection through which Lingvo's pipeline overwrites the global step
# that step-seeded random ops read (gpipe.SetOverWriteGlobalStep).
OVERWRITE_GLOBAL_STEP_COLLECTION = lingvo_gpipe._OVERWRITE_GLOBAL_STEP_COLLECTION  # pylint: disable=protected-access


def RecursiveMap(nested_map, fn):
  """NestedMap._RecursiveMap(fn): fn(key path, value) over every leaf."""
  return nested_map._RecursiveMap(fn)  # pylint: disable=protected-access


@contextlib.contextmanager
def StepSeedPairFn(fn):
  """py_utils.GenerateStepSeedPair is `fn` inside (a process-wide switch).

  Lingvo's stateless random layers call py_utils.GenerateStepSeedPair by
  module attribute; a schedule building a cell inline seeds them as
  Lingvo's pipeline loop would.
  """
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  saved = py_utils.GenerateStepSeedPair
  py_utils.GenerateStepSeedPair = fn
  try:
    yield
  finally:
    py_utils.GenerateStepSeedPair = saved


def SaverVariables(ckpt):
  """What a graph-mode Checkpointer's saver saves: a list or {key: var}."""
  return ckpt._saver._var_list  # pylint: disable=protected-access


def AsyncCopiesInitializer(ckpt):
  """The initializer of Lingvo's async-save copies of the variables, or None.

  Lingvo's custom saver keeps copies (async_ckpt/) that checkpoints do not
  hold; its restore re-initializes them, and so must a restore of ours.
  """
  inner = getattr(ckpt._saver, '_saver', None)  # pylint: disable=protected-access
  return getattr(inner, '_copied_vars_initializer', None)


def _InDir(directory, path):
  return os.path.normpath(os.path.dirname(path)) == os.path.normpath(directory)


class _RelativeStateSaver(lingvo_saver.Saver):
  """Lingvo's saver; its `checkpoint` state file names its own files by name.

  Only the file changes: the saver reads the names back joined with its
  logdir, as it wrote them (its garbage collection matches `.../ckpt-N`).
  """

  def _GetState(self):
    state = super()._GetState()
    full = lambda p: os.path.join(self._logdir, p) if (
        p and not os.path.dirname(p)) else p
    state.model_checkpoint_path = full(state.model_checkpoint_path)
    state.all_model_checkpoint_paths[:] = [
        full(p) for p in state.all_model_checkpoint_paths]
    return state

  def _SetState(self, state):
    written = type(state)()
    written.CopyFrom(state)
    name = lambda p: os.path.basename(p) if _InDir(self._logdir, p) else p
    written.model_checkpoint_path = name(written.model_checkpoint_path)
    written.all_model_checkpoint_paths[:] = [
        name(p) for p in written.all_model_checkpoint_paths]
    super()._SetState(written)  # An atomic write, as Lingvo's.


def WriteRelativeStateFile(ckpt):
  """A graph-mode Checkpointer's saver names its checkpoints relatively.

  Its `checkpoint` state file then names the logdir's own checkpoints by
  file name (`ckpt-00000100`), so a copied or moved logdir reads its own.
  """
  inner = ckpt._saver._saver  # pylint: disable=protected-access
  if type(inner) is lingvo_saver.Saver:  # pylint: disable=unidiomatic-typecheck
    # Same state, two methods overridden: the saver's ops are already built.
    inner.__class__ = _RelativeStateSaver
  elif isinstance(inner, tf.train.Saver):
    # tf.train.Saver(save_relative_paths=True), which Lingvo does not pass.
    inner._save_relative_paths = True  # pylint: disable=protected-access


def OverridesTimeAxisTrim(task_cls) -> bool:
  """Whether a BatchMajorLanguageModel subclass replaces Lingvo's private
  `_TrimIfPossible` (which trims the time axis to each batch's longest
  sentence off TPU): such a task decides its time axis itself."""
  from lingvo.tasks.lm import model as lm_model  # pylint: disable=g-import-not-at-top
  own = lm_model.BatchMajorLanguageModel._TrimIfPossible  # pylint: disable=protected-access
  return getattr(task_cls, '_TrimIfPossible', own) is not own


def NameSavesFromSnapshot(ckpt):
  """A Checkpointer's async saves are named by the step they store.

  Lingvo's async saver copies the variables in one session run and reads the
  step that names the checkpoint in the next: a training step run between
  the two named `ckpt-N` a checkpoint holding step N-1 or earlier. Here the
  name comes from the copy of `global_step` the checkpoint holds (its save
  op is rebuilt over that prefix). A no-op for other savers.
  """
  # pylint: disable=protected-access
  inner = getattr(ckpt._saver, '_saver', None)
  if not isinstance(inner, lingvo_saver.Saver) or not inner._async_save:
    return
  key = lingvo_saver._VarKey
  copies = {key(v): c for v, c in zip(inner._vars, inner._copied_vars)}
  if 'global_step' not in copies:
    return
  originals = {id(c): v for v, c in zip(inner._vars, inner._copied_vars)}
  graph = inner._var_graph
  with graph.as_default():
    with graph.device(copies['global_step'].device):
      step = tf.reshape(copies['global_step'].read_value(), [])
    prefix = tf.strings.join([inner._logdir_ph, '/ckpt-',
                              tf.as_string(step, width=8, fill='0')])
  inner._save_global_step = step
  inner._save_prefix = prefix
  inner._save_op = inner._AddShardedSaveOps(
      inner._copied_vars, prefix, lambda c: key(originals[id(c)]))
  # pylint: enable=protected-access


def ExecModuleWith(name, replacements):
  """A fresh module object of Lingvo's module `name`, its source executed
  with `replacements` ({module name: module}) standing in sys.modules for
  the duration (restored after, so the process sees Lingvo's own)."""
  spec = importlib.util.find_spec(name)
  module = importlib.util.module_from_spec(spec)
  saved = {k: sys.modules[k] for k in replacements if k in sys.modules}
  sys.modules.update(replacements)
  try:
    spec.loader.exec_module(module)
  finally:
    for k in replacements:
      if k in saved:
        sys.modules[k] = saved[k]
      else:
        del sys.modules[k]
  return module


def SkipInputReset(inp) -> bool:
  """Makes `inp`'s Reset (this instance's) do nothing where it is
  BaseInputGenerator's, which Lingvo's op-based inputs lack; whether it did.
  For an input read once from its start."""
  from lingvo.core import base_input_generator  # pylint: disable=g-import-not-at-top
  if type(inp).Reset is not base_input_generator.BaseInputGenerator.Reset:
    return False
  inp.Reset = lambda sess=None: None
  return True
