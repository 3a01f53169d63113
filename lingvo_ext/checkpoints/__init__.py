"""Checkpoint safety for the trainer: intact restores, finite saves.

Three parts, one concept each: `files` (a logdir's checkpoints on disk and
its `checkpoint` state file: intact restores, repairs, a moved logdir, the
training-finished mark), `reader` (the checkpoint every job reads: the
newest intact one, the damaged ones named) and `checkpointers` (Lingvo's
Checkpointer with finite saves and restores across cuts). Their public
names are here too: `lingvo_ext.checkpoints.X` is the path users hold.
"""

# pylint: disable=unused-import,g-multiple-import
from lingvo_ext.checkpoints.checkpointers import CrossCutCheckpointer
from lingvo_ext.checkpoints.checkpointers import FiniteChecks
from lingvo_ext.checkpoints.checkpointers import NewCheckpointer
from lingvo_ext.checkpoints.checkpointers import NonFiniteVariables
from lingvo_ext.checkpoints.checkpointers import TrainingCheckpointer
from lingvo_ext.checkpoints.files import CheckpointPaths
from lingvo_ext.checkpoints.files import CheckpointProblem
from lingvo_ext.checkpoints.files import CheckpointStep
from lingvo_ext.checkpoints.files import ClearTrainingFinished
from lingvo_ext.checkpoints.files import DropLatestIfNonFinite
from lingvo_ext.checkpoints.files import FallBackToIntactCheckpoint
from lingvo_ext.checkpoints.files import LatestCheckpoint
from lingvo_ext.checkpoints.files import LocalizeStateFile
from lingvo_ext.checkpoints.files import MarkTrainingFinished
from lingvo_ext.checkpoints.files import OwnCopy
from lingvo_ext.checkpoints.files import PointStatePast
from lingvo_ext.checkpoints.files import RebuildStateFile
from lingvo_ext.checkpoints.files import StateFileProblem
from lingvo_ext.checkpoints.files import TrainingFinished
from lingvo_ext.checkpoints.reader import NewestIntactCheckpoint
from lingvo_ext.checkpoints.reader import ReadProblem
from lingvo_ext.checkpoints.reader import SkippedLine
