"""Pipeline schedules: the public face of the engine (lingvo_ext/pipeline/).

A schedule says how micro-batches flow through a PipeliningLayer's cells.
Every schedule has one record (engine/records.py); everything here derives
from the records.

`SCHEDULES` maps each schedule's name (PipeliningLayer's `schedule` param) to
its schedule function,

  Schedule(layer, theta, inputs, num_micro_batches) -> outputs

where `layer` is the `gpipe.PipeliningLayer` (its cells, devices and params),
`theta` its weights, `inputs` the tuple of FProp inputs after the layer's
`before_tpl` layers and `outputs` the last cell's outputs for the whole batch.
A record with a generator runs on the `Interpreter`; 'recurrent' is Lingvo's
loop (`Recurrent`).

Every schedule but 'recurrent' is data: a pure-Python function of a small
stage description (`StageSpec`) that returns, for every device, the ordered
list of its actions. A schedule's lists can be built (`Build`), printed
(`FormatSchedule`), checked for completeness and deadlock (`CheckSchedule`)
and simulated over action costs (`Simulate`) before any graph is built, and
written as text and read back (`FormatLists`, `ParseLists`).

An action is (kind, stage, micro_batch), its kind a `Kind` equal to its
letter:

- 'F': the stage's forward pass of the micro-batch.
- 'R': its forward pass recomputed in the backward pass (re-materialisation).
- 'B': its backward pass: input and weight gradients.
- 'I': the input gradients alone; 'W': the weight gradients alone (a backward
  pass split in two, as zero-bubble schedules do).

Stages sit on devices as the schedule's record says (`StageSpec.placement`):
round robin, stage s on device s % num_devices, or 'v' (down the devices and
back up, 'zbv').

The lists half needs no TensorFlow: importing this module imports none. The
TensorFlow half (`SCHEDULES`, `Interpreter`, `ListSchedule`, `Recurrent`,
`CellRandomness`, `CastHere`, `ToTuple`) is imported on first use. Code that
must stay TensorFlow-free (the planner) imports the engine's modules up to
records directly.
"""

import importlib

# pylint: disable=unused-import,g-multiple-import
from lingvo_ext.pipeline import records
from lingvo_ext.pipeline.generators import GPipe
from lingvo_ext.pipeline.generators import Interleaved1F1B
from lingvo_ext.pipeline.generators import OneFOneB
from lingvo_ext.pipeline.generators import OneFOneBGroupedWeights
from lingvo_ext.pipeline.generators import ZeroBubble
from lingvo_ext.pipeline.kinds import KINDS
from lingvo_ext.pipeline.kinds import PLACEMENTS
from lingvo_ext.pipeline.kinds import Action
from lingvo_ext.pipeline.kinds import Kind
from lingvo_ext.pipeline.kinds import PlaceStage
from lingvo_ext.pipeline.kinds import ScheduleLists
from lingvo_ext.pipeline.kinds import StageSpec
from lingvo_ext.pipeline.records import ACTION_SCHEDULES
from lingvo_ext.pipeline.records import ALWAYS_RECOMPUTE
from lingvo_ext.pipeline.records import LINEAR_LOSS_ONLY
from lingvo_ext.pipeline.records import ORDERED_KINDS
from lingvo_ext.pipeline.records import SIZED_WEIGHT_GRADIENT_RUNS
from lingvo_ext.pipeline.records import Build
from lingvo_ext.pipeline.records import Placed
from lingvo_ext.pipeline.runs import PreviousOnDevice
from lingvo_ext.pipeline.runs import Waits
from lingvo_ext.pipeline.runs import WeightGradientRunLength
from lingvo_ext.pipeline.runs import WeightGradientRuns
from lingvo_ext.pipeline.simulate import CheckSchedule
from lingvo_ext.pipeline.simulate import CriticalPath
from lingvo_ext.pipeline.simulate import Deps
from lingvo_ext.pipeline.simulate import FormatSchedule
from lingvo_ext.pipeline.simulate import Simulate
from lingvo_ext.pipeline.simulate import Timeline
from lingvo_ext.pipeline.simulate import UnitCost
from lingvo_ext.pipeline.text import FormatLists
from lingvo_ext.pipeline.text import ParseLists
from lingvo_ext.pipeline.transforms import FoldOntoDevices
from lingvo_ext.pipeline.transforms import ForwardsFirst
from lingvo_ext.pipeline.transforms import GroupWeightGradients

# The TensorFlow half: {name: the module that defines it}.
_TF_HALF = {
    'CastHere': 'lingvo_ext.pipeline.tensors',
    'CellRandomness': 'lingvo_ext.pipeline.randomness',
    'Interpreter': 'lingvo_ext.pipeline.interpreter',
    'ListSchedule': 'lingvo_ext.pipeline.interpreter',
    'Recurrent': 'lingvo_ext.pipeline.recurrent',
    'ToTuple': 'lingvo_ext.pipeline.nest_util',
}


def _Schedules():
  """{name: schedule function} of every record."""
  interpreter = importlib.import_module(_TF_HALF['ListSchedule'])
  recurrent = importlib.import_module(_TF_HALF['Recurrent'])
  return {r.name: (interpreter.ListSchedule(r.name) if r.generator else
                   recurrent.Recurrent) for r in records.RECORDS}


def __getattr__(name):
  # PEP 562: only names not defined above come here, each once (cached).
  if name == 'SCHEDULES':
    value = _Schedules()
  elif name in _TF_HALF:
    value = getattr(importlib.import_module(_TF_HALF[name]), name)
  else:
    raise AttributeError('module %r has no attribute %r' % (__name__, name))
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_TF_HALF) | {'SCHEDULES'})
