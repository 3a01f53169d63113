"""bench/plan.py's models beyond the shipped experiments.

- `fc256`, `fc512`, `fc1024`: bench/pipeline.py's FC stack at those widths
  (`fc` is fc512), where the step is FLOPs, not per-op time: on two devices
  two cells can beat one.
- `lingvo_lm`: the scaled-down copy of Lingvo's OneBWdsGPipeTransformer
  (tests/support/flagship_testlib.py, batch-major), a pipeline of Lingvo's
  task code (task.lm.stack), planned on the tree path with its cells as cut.
- `lingvo_mt`: the scaled-down GPipe Transformer NMT experiment on Lingvo's
  NmtInput (tests/support/mt_testlib.py), an encoder-decoder stack, likewise.

A tree model's sweep is every plan of its first pipeline with its cells as
cut, one replica; its references are tree_calibration.ReferencePlans; its
predicted peak RSS is the memory model's (planner/memory_model.py) with the
task's variables outside the pipeline added.
"""

import os
import re
import sys
import tempfile
from typing import Dict
from typing import List
from typing import Optional

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FC_DEFAULT_WIDTH = 512
FC_WIDTHS = (256, 512, 1024)
LINGVO_LM = 'lingvo_lm'
LINGVO_MT = 'lingvo_mt'
# name -> (the test library that writes its data and module, its model).
TREE_MODELS = {LINGVO_LM: ('flagship_testlib', 'MODEL'),
               LINGVO_MT: ('mt_testlib', 'MODEL')}

_FC = re.compile(r'^fc(\d*)$')
_TREES: Dict[str, tuple] = {}


def FcWidth(model: str) -> Optional[int]:
  """The FC stack's width of `model` ('fc', 'fc256', ...), else None."""
  m = _FC.match(model)
  if not m:
    return None
  return int(m.group(1)) if m.group(1) else FC_DEFAULT_WIDTH


def IsTree(model: str) -> bool:
  return model in TREE_MODELS


def Tree(model: str):
  """(registered name, params, pipes, other variables' bytes, optimizer
  slots) of a tree model, its data written once per process (TF)."""
  if model not in _TREES:
    import importlib  # pylint: disable=g-import-not-at-top
    if _REPO not in sys.path:
      sys.path.insert(0, _REPO)
    from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
    from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
    from lingvo_ext.planner import tree_memory  # pylint: disable=g-import-not-at-top
    lib_name, attr = TREE_MODELS[model]
    lib = importlib.import_module('tests.support.' + lib_name)
    root = tempfile.mkdtemp(prefix='bench_plan_%s_' % model)
    lib.Write(root)
    lib.Register(root)
    name = getattr(lib, attr)
    cfg = planner.ExperimentParams(name)
    pipes = tree.ProfileTree(cfg, name)
    mem = tree_memory.ProfileTaskMemory(cfg)
    _TREES[model] = (name, cfg, pipes, mem.other_param_bytes,
                     mem.optimizer_slots)
  return _TREES[model]


def TreeSweep(profile, devices: int, static_shapes: bool = True,
              micro_batches=None) -> List:
  """Every plan of a pipeline that comes cut: its K cells, one replica."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  k = len(profile.layers)
  return [p for p in planner.Enumerate(
      profile, devices, sync_choices=('shared',), micro_batches=micro_batches,
      static_shapes=static_shapes) if p.num_cells == k and p.replicas == 1]


def TreeStep(model: str, plan):
  """(session, train op) of a tree model under `plan` (TF)."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  name, cfg, pipes, _, _ = Tree(model)
  return planner.BuildExperimentStep(
      name, plan, model_params=cfg,
      apply=lambda params, p: tree.ApplyTree(params, [(pipes[0], p)]))


def PredictedRss(model: str, profile, plan, constants) -> float:
  """The memory model's peak RSS of `plan` (a tree model's other variables,
  their gradients and slots added)."""
  from lingvo_ext.planner import memory_model  # pylint: disable=g-import-not-at-top
  got = memory_model.Predict(profile, plan, constants)
  if IsTree(model):
    _, _, _, others, slots = Tree(model)
    for term, factor in (('variables', 1), ('gradients', 1),
                         ('optimizer_slots', slots)):
      got = memory_model.Extra(got, term, others * factor)
  return got.rss_bytes
