"""Pipeline schedules: how micro-batches flow through a PipeliningLayer's cells.

The public face of the engine (lingvo_ext/core/engine/): `SCHEDULES` maps
each schedule's name (PipeliningLayer's `schedule` param) to its function,
built from the schedule's record (engine/records.py).
"""

# pylint: disable=unused-import
from lingvo_ext.core.engine.interpreter import Interpreter
from lingvo_ext.core.engine.interpreter import ListSchedule
from lingvo_ext.core.engine.pipelines import SCHEDULES
from lingvo_ext.core.engine.randomness import CellRandomness
from lingvo_ext.core.engine.records import ALWAYS_RECOMPUTE
from lingvo_ext.core.engine.records import LINEAR_LOSS_ONLY
from lingvo_ext.core.engine.recurrent import Recurrent
from lingvo_ext.core.engine.tensors import CastHere
from lingvo_ext.core.nest_util import ToTuple
