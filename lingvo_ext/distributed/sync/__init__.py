"""Gradient synchronisation of data-parallel replicas (AutoDist's strategies).

A task with R data-parallel replicas (Lingvo's splits: R = num_cpu_devices /
worker_split_size per worker, times the worker replicas) builds one graph in
which replica r runs the whole (pipelined) model on its own devices. How the
replicas' gradients meet is the strategy, `PipelinedTask.gradient_sync`, one
module each:

- 'shared' (shared.py): Lingvo's behaviour, one copy of each variable.
- 'all_reduce' (all_reduce.py): a copy per replica; dense gradients
  all-reduced, sparse ones all-gathered, never densified.
- 'parameter_server' (parameter_server.py): one copy on a ps device, fed
  through accumulators that release the mean of the R gradients.
- 'hybrid' (hybrid.py): dense variables by 'all_reduce', sparse ones (read
  only by gathers, e.g. embedding tables) by 'parameter_server'.

base.py holds what they share: the replicas' reads and the update of every
replica's copies; `GradientSync(name, strategy, ...)` makes the strategy's
class. learners.py is the learners' hook (`Applying`, `WithSyncLearners`),
checks.py the params' checks.

`accumulate_steps` = N > 1 (any strategy) applies one update every N steps
from the mean of the N steps' gradients, using the same TensorFlow
accumulators, so it equals one step of an N-times larger batch, sparse
gradients included. Gradients are clipped after accumulation, like those of
the large batch. (Lingvo's optimizer.Accumulator clips each step's gradient
before it accumulates, and densifies IndexedSlices, so it is not used.)

Each replica's gradient is that of R times the global loss with respect to
its own copy (or its own read of the shared copy). The global loss is
Lingvo's weighted mean over replicas, so the mean of these R gradients is the
gradient of one replica training on the whole global batch.

The names below are the interface (`sync.X`).
"""

# pylint: disable=g-importing-member,unused-import
# Each strategy's module registers its class (`strategy=` of GradientSync).
from lingvo_ext.distributed.sync import all_reduce
from lingvo_ext.distributed.sync import hybrid
from lingvo_ext.distributed.sync import parameter_server
from lingvo_ext.distributed.sync import shared
from lingvo_ext.distributed.sync.base import CommunicationStats
from lingvo_ext.distributed.sync.base import GradientSync
from lingvo_ext.distributed.sync.checks import STRATEGIES
from lingvo_ext.distributed.sync.checks import CheckParams
from lingvo_ext.distributed.sync.checks import CheckReplicas
from lingvo_ext.distributed.sync.learners import Applying
from lingvo_ext.distributed.sync.learners import SyncLearnerMixin
from lingvo_ext.distributed.sync.learners import WithSyncLearners
