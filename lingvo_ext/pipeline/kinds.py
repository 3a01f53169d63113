"""Actions and stage descriptions: what a schedule's lists are made of.

An action is (kind, stage, micro_batch). A schedule is, per device, the list
of actions it runs (`ScheduleLists`). Nothing here needs TensorFlow.
"""

import dataclasses
import enum
from typing import List
from typing import NamedTuple


class Kind(enum.StrEnum):
  """What an action does; equal to its one-letter string ('F' == Kind.F)."""
  F = 'F'  # The stage's forward pass of the micro-batch.
  R = 'R'  # Its forward pass recomputed in the backward pass.
  B = 'B'  # Its backward pass: input and weight gradients.
  I = 'I'  # The input gradients alone (a backward pass split in two).
  W = 'W'  # The weight gradients alone.


KINDS = tuple(Kind)


class Action(NamedTuple):
  """One step of one device: `kind` of stage `stage` on `micro_batch`."""
  kind: Kind
  stage: int
  micro_batch: int

  def __str__(self):
    return '%s%d.%d' % (self.kind, self.stage, self.micro_batch)


ScheduleLists = List[List[Action]]

# How stages sit on devices. 'round_robin': stage s on device s % D (Lingvo's
# model split; Megatron's interleaving). 'v': stages go down the devices and
# back up (0..D-1, then D-1..0), so a device holds stages d and 2D - 1 - d
# (the zero-bubble paper's V-shape: the last stage sits with the first).
PLACEMENTS = ('round_robin', 'v')


def PlaceStage(placement: str, num_devices: int, stage: int) -> int:
  """The device of `stage` under `placement` (see PLACEMENTS)."""
  if placement == 'round_robin':
    return stage % num_devices
  if placement == 'v':
    r = stage % (2 * num_devices)
    return r if r < num_devices else 2 * num_devices - 1 - r
  raise ValueError('placement=%r; use one of %s.' % (placement, PLACEMENTS))


@dataclasses.dataclass(frozen=True)
class StageSpec:
  """What a schedule needs to know of a pipeline.

  Attributes:
    num_stages: Pipeline stages (cells), K.
    num_devices: Devices they run on (see `placement`).
    num_micro_batches: Micro-batches, M.
    recompute: Whether each stage's forward pass is recomputed ('R') before
      its backward pass.
    weight_gradient_run: How many micro-batches' weight gradients a run
      computes at once, where the engine picks it
      (`WeightGradientRunLength`): GPipe ('unrolled') with recompute, one run
      of 'W's after every that many micro-batches' 'R' and 'I', their
      recomputed activations alive until it (1: 'R' and 'B' per
      micro-batch); 1F1B ('1f1b') without recompute, runs of that many
      micro-batches where it is more than K.
    placement: How stages sit on devices (`PLACEMENTS`): 'round_robin',
      stage s on device s % num_devices; 'v', down and back up.
  """
  num_stages: int
  num_devices: int
  num_micro_batches: int
  recompute: bool = False
  weight_gradient_run: int = 1
  placement: str = 'round_robin'

  def __post_init__(self):
    for name in ('num_stages', 'num_devices', 'num_micro_batches',
                 'weight_gradient_run'):
      if getattr(self, name) < 1:
        raise ValueError('StageSpec: %s=%r must be >= 1.' %
                         (name, getattr(self, name)))
    if self.num_devices > self.num_stages:
      raise ValueError(
          'StageSpec: num_devices=%d > num_stages=%d; a device needs a '
          'stage: use at most %d devices.' %
          (self.num_devices, self.num_stages, self.num_stages))
    if self.placement not in PLACEMENTS:
      raise ValueError('StageSpec: placement=%r; use one of %s.' %
                       (self.placement, PLACEMENTS))

  def Device(self, stage: int) -> int:
    return PlaceStage(self.placement, self.num_devices, stage)

  def Stages(self, device: int) -> List[int]:
    return [s for s in range(self.num_stages) if self.Device(s) == device]
