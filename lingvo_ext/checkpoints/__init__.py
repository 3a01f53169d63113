"""Checkpoint safety for the trainer: intact restores, finite saves.

Three parts, one concept each: `files` (a logdir's checkpoints on disk and
its `checkpoint` state file: intact restores, repairs, a moved logdir, the
training-finished mark), `reader` (the checkpoint every job reads: the
newest intact one, the damaged ones named) and `checkpointers` (Lingvo's
Checkpointer with finite saves and restores across cuts). Their public
names are here too: `lingvo_ext.checkpoints.X` is the path users hold.
"""

# pylint: disable=unused-import,g-multiple-import
from lingvo_ext.checkpoints.checkpointers import (
    FiniteChecks, NewCheckpointer, NonFiniteVariables, TrainingCheckpointer)
from lingvo_ext.checkpoints.files import (
    CheckpointPaths, CheckpointProblem, CheckpointStep, ClearTrainingFinished,
    LatestCheckpoint, LocalizeStateFile, MarkTrainingFinished,
    RebuildStateFile, TrainingFinished)
from lingvo_ext.checkpoints.reader import NewestIntactCheckpoint, ReadProblem
