"""Pipeline schedules as data: the ordered actions of each device.

The public face of the engine's lists (lingvo_ext/core/engine/): a schedule
is a pure-Python function of a small stage description (`StageSpec`) that
returns, for every device, the list of its actions; nothing here needs
TensorFlow. A schedule's lists can be built (`Build`), printed
(`FormatSchedule`), checked for completeness and deadlock (`CheckSchedule`)
and simulated over action costs (`Simulate`) before any graph is built.

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
"""

# pylint: disable=unused-import,g-multiple-import
from lingvo_ext.core.engine.generators import (
    GPipe, Interleaved1F1B, OneFOneB, OneFOneBGroupedWeights, ZeroBubble)
from lingvo_ext.core.engine.kinds import (
    KINDS, PLACEMENTS, Action, Kind, PlaceStage, ScheduleLists, StageSpec)
from lingvo_ext.core.engine.records import (
    ACTION_SCHEDULES, ORDERED_KINDS, SIZED_WEIGHT_GRADIENT_RUNS, Build, Placed)
from lingvo_ext.core.engine.runs import (
    PreviousOnDevice, Waits, WeightGradientRunLength, WeightGradientRuns)
from lingvo_ext.core.engine.simulate import (
    CheckSchedule, CriticalPath, Deps, FormatSchedule, Simulate, Timeline,
    UnitCost)
from lingvo_ext.core.engine.transforms import (
    FoldOntoDevices, ForwardsFirst, GroupWeightGradients)
