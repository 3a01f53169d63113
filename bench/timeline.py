"""The traced-step analysis the benches use: `lingvo_ext.tools.step_trace`.

Kept under this name for the benches (`from bench import timeline`).
"""

# pylint: disable=unused-import
from lingvo_ext.tools.step_trace import CALL_OPS
from lingvo_ext.tools.step_trace import Category
from lingvo_ext.tools.step_trace import Classify
from lingvo_ext.tools.step_trace import HostBreakdown
from lingvo_ext.tools.step_trace import HostEvent
from lingvo_ext.tools.step_trace import HostOpEvents
from lingvo_ext.tools.step_trace import HostTraceToChrome
from lingvo_ext.tools.step_trace import IdleFraction
from lingvo_ext.tools.step_trace import Interval
from lingvo_ext.tools.step_trace import BusyIntervals
from lingvo_ext.tools.step_trace import MicroBatch
from lingvo_ext.tools.step_trace import OpType
from lingvo_ext.tools.step_trace import Phase
from lingvo_ext.tools.step_trace import PlotGantt
from lingvo_ext.tools.step_trace import ShortDevice
from lingvo_ext.tools.step_trace import StepStatsToChrome
from lingvo_ext.tools.step_trace import Span
from lingvo_ext.tools.step_trace import Union
from lingvo_ext.tools.step_trace import WriteJson
