"""The experiment's params, built once per dataset in a trainer process.

The trainer builds the training params once (after --plan=auto sets the plan
on them, typed) and hands them down: its checks, the input watch and every
runner (Lingvo's RunnerManager asks its `model_registry`, which is a
`ModelRegistry` here) take copies of that one build. An evaler's or
decoder's dataset is built once too, on first use, then handed to
`eval_build` (the runtime's: XLA's 'auto' resolved for the eval build,
runtime/jit_resolve.py).
"""

import threading

import lingvo.compat as tf
from lingvo.core import base_model_params

from lingvo_ext import registry
from lingvo_ext.tasks import experiment_params


class RunParams:
  """{dataset: params}, each built once with the run's overrides.

  Args:
    options: trainer_flags.Options (model, overrides, engine).
    train: The 'Train' params already built (and planned), or None.
    eval_build: Called with each other dataset's params when first built;
      returns lines for the log (None: nothing).
  """

  def __init__(self, options, train=None, eval_build=None):
    self._options = options
    self._eval_build = eval_build
    self._built = {} if train is None else {'Train': train}
    self._lock = threading.Lock()  # Runners are built on several threads.

  def _Build(self, dataset):
    o = self._options
    with self._lock:
      if dataset not in self._built:
        params = experiment_params.GetParams(
            o.model, dataset, o.model_params_override,
            o.model_params_file_override, o.gpipe_engine)
        if dataset != 'Train' and self._eval_build:
          for line in self._eval_build(params):
            tf.logging.info('%s', line)
        self._built[dataset] = params
      return self._built[dataset]

  def Train(self):
    """The training params themselves (not a copy): the run's one build."""
    return self._Build('Train')

  def Get(self, dataset):
    """A copy of `dataset`'s params (Lingvo's runners change theirs)."""
    return self._Build(dataset).Copy()

  def Dataset(self, dataset):
    """`dataset`'s params, as Lingvo looks it up (retried title-cased).

    Raises:
      ValueError: the experiment defines neither name (one line).
    """
    for name in (dataset, dataset.title()):
      try:
        return self._Build(name)
      except base_model_params.DatasetError:
        continue
    o = self._options
    raise ValueError(
        f'--job: --model={o.model} defines no dataset {dataset!r} (nor '
        f'{dataset.title()!r}) for its evaler or decoder; use a job of a '
        'dataset it defines, e.g. --job=evaler_dev.')


class ModelRegistry:
  """What Lingvo's RunnerManager asks its `model_registry` for.

  RunnerManager.model_registry is Lingvo's extension point for another
  registry; this one serves copies of the run's params (RunParams).
  """

  def __init__(self, run_params):
    self._run_params = run_params

  def GetParams(self, class_key, dataset_name):
    del class_key  # The run's experiment.
    return self._run_params.Get(dataset_name)

  def GetClass(self, class_key):
    return registry.ExperimentClass(class_key)
