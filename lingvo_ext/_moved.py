"""Old import paths of modules that moved, kept working for users' code.

`import lingvo_ext.core.planner.plans` (an old path) gives the module now at
`lingvo_ext.planner.plans`: the same module object, imported once. The table
is data; docs/architecture.md lists the moves. A test imports every old path.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# {old dotted path: new dotted path}. A package's entry covers only the
# package itself: list its modules too.
MOVED = {
    # The planner and tracing wings (folders = floors).
    'lingvo_ext.core.planner': 'lingvo_ext.planner',
    'lingvo_ext.core.planner.application': 'lingvo_ext.planner.application',
    'lingvo_ext.core.planner.calibration': 'lingvo_ext.planner.calibration',
    'lingvo_ext.core.planner.choice': 'lingvo_ext.planner.choice',
    'lingvo_ext.core.planner.model_profile': 'lingvo_ext.planner.model_profile',
    'lingvo_ext.core.planner.plans': 'lingvo_ext.planner.plans',
    'lingvo_ext.core.planner.prediction': 'lingvo_ext.planner.prediction',
    'lingvo_ext.core.planner.tf_profiling': 'lingvo_ext.planner.tf_profiling',
    'lingvo_ext.core.planner.tree': 'lingvo_ext.planner.tree',
    'lingvo_ext.tools.step_trace': 'lingvo_ext.tracing.step_trace',

    # The runtime wing.
    'lingvo_ext.disk_space': 'lingvo_ext.runtime.disk_space',
    'lingvo_ext.distributed.trainer_lib': 'lingvo_ext.runtime.trainer_lib',
    'lingvo_ext.local_controller': 'lingvo_ext.runtime.local_controller',
    'lingvo_ext.local_evaler': 'lingvo_ext.runtime.local_evaler',
    'lingvo_ext.local_trainer': 'lingvo_ext.runtime.local_trainer',
    'lingvo_ext.memory_check': 'lingvo_ext.runtime.memory_check',
    'lingvo_ext.one_build': 'lingvo_ext.runtime.one_build',
    'lingvo_ext.prepared_step': 'lingvo_ext.runtime.prepared_step',
    'lingvo_ext.progress': 'lingvo_ext.runtime.progress',
    'lingvo_ext.runner_state': 'lingvo_ext.runtime.runner_state',
    'lingvo_ext.runners': 'lingvo_ext.runtime.runners',
    'lingvo_ext.shutdown': 'lingvo_ext.runtime.shutdown',
    'lingvo_ext.trainer_flags': 'lingvo_ext.runtime.trainer_flags',

    # The engine made whole, with one public face (core/schedules.py).
    'lingvo_ext.core.actions': 'lingvo_ext.core.schedules',
    'lingvo_ext.core.cell_function': 'lingvo_ext.core.engine.cell_function',
    'lingvo_ext.core.engine.pipelines': 'lingvo_ext.core.schedules',
    'lingvo_ext.core.graph_state': 'lingvo_ext.core.engine.graph_state',
    'lingvo_ext.core.jit_random': 'lingvo_ext.core.engine.jit_random',
    'lingvo_ext.core.matmul_grad': 'lingvo_ext.core.engine.matmul_grad',

    # The bundled experiments and other splits.
    'lingvo_ext.distributed.gradient_sync': 'lingvo_ext.distributed.sync',
    'params': 'lingvo_ext.experiments',
    'params.base': 'lingvo_ext.experiments.base',
    'params.image': 'lingvo_ext.experiments.image',
    'params.lm': 'lingvo_ext.experiments.lm',

}


class _Loader(importlib.abc.Loader):

  def __init__(self, new):
    self._new = new

  def create_module(self, spec):
    return importlib.import_module(self._new)

  def exec_module(self, module):
    # The module under its new name is already executed; aliasing only.
    pass


class _Finder(importlib.abc.MetaPathFinder):

  def find_spec(self, fullname, path=None, target=None):
    new = MOVED.get(fullname)
    if new is None:
      return None
    is_package = hasattr(importlib.import_module(new), '__path__')
    return importlib.util.spec_from_loader(
        fullname, _Loader(new), is_package=is_package)


def Install():
  """Makes every old path in MOVED importable; idempotent."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    # First: a moved package's old path has its new __path__, where the path
    # finder would load the modules a second time under their old names.
    sys.meta_path.insert(0, _Finder())
