"""An automatic pipeline plan: cells, cut, micro-batches, schedule, replicas.

Given a model's per-layer profile and N devices, the planner lists every plan
(`plans.Enumerate`), predicts each one's step time and memory
(`prediction.Predict`), ranks them and, where measured, chooses by a sign test
(`choice`), and applies the chosen one to an experiment's params
(`application`). `tf_profiling` is the TensorFlow half: it profiles an
experiment's layers, probes this host and times plans; `calibration` fits the
probed machine to timed reference plans; `measuring` times plans for
`--measure`; `auto` chooses and applies a plan for the trainer's --plan=auto
(`auto.PlanParams`) and for `lingvo_ext.tools.plan`; `tree` plans pipelines
that come cut. `application`, `calibration`, `choice`, `model_profile`,
`plans` and `prediction` are pure Python. docs/architecture.md shows where the
planner sits.

The names below are the planner's interface (`planner.X`).
"""

# pylint: disable=g-importing-member,unused-import
from lingvo_ext.planner.application import ApplyPlan
from lingvo_ext.planner.application import Command
from lingvo_ext.planner.application import Describe
from lingvo_ext.planner.application import JoinOverrides
from lingvo_ext.planner.application import Overrides
from lingvo_ext.planner.application import OverrideString
from lingvo_ext.planner.application import Table
from lingvo_ext.planner.application import TrainerFlags
from lingvo_ext.planner.calibration import DEFAULT_BYTES_PER_OP
from lingvo_ext.planner.calibration import Calibrate
from lingvo_ext.planner.calibration import CalibrateXla
from lingvo_ext.planner.calibration import ReferencePlans
from lingvo_ext.planner.calibration import XlaReferencePlans
from lingvo_ext.planner.choice import MEASURE_ALPHA
from lingvo_ext.planner.choice import Choose
from lingvo_ext.planner.choice import MeasuredChoice
from lingvo_ext.planner.choice import MeasuredNoise
from lingvo_ext.planner.choice import MinRounds
from lingvo_ext.planner.choice import Rank
from lingvo_ext.planner.choice import SignTestP
from lingvo_ext.planner.choice import Twin
from lingvo_ext.planner.model_profile import FormatSize
from lingvo_ext.planner.model_profile import LayerProfile
from lingvo_ext.planner.model_profile import Machine
from lingvo_ext.planner.model_profile import ModelProfile
from lingvo_ext.planner.model_profile import ParseSize
from lingvo_ext.planner.plans import Candidate
from lingvo_ext.planner.plans import Enumerate
from lingvo_ext.planner.plans import Measurement
from lingvo_ext.planner.plans import Plan
from lingvo_ext.planner.plans import PlanError
from lingvo_ext.planner.plans import PlanFromDict
from lingvo_ext.planner.plans import Prediction
from lingvo_ext.planner.prediction import SYNC_OPS_PER_VAR
from lingvo_ext.planner.prediction import Accumulations
from lingvo_ext.planner.prediction import ActionSchedule
from lingvo_ext.planner.prediction import GatedKinds
from lingvo_ext.planner.prediction import GraphOps
from lingvo_ext.planner.prediction import HandoffBytes
from lingvo_ext.planner.prediction import Predict
from lingvo_ext.planner.prediction import PredictAll
from lingvo_ext.planner.prediction import Stages
from lingvo_ext.planner.prediction import WeightGradientRun
from lingvo_ext.planner.prediction import Xla
from lingvo_ext.planner.tf_profiling import BuildExperimentStep
from lingvo_ext.planner.tf_profiling import ExperimentParams
from lingvo_ext.planner.tf_profiling import MeasureJob
from lingvo_ext.planner.tf_profiling import ProbeMachine
from lingvo_ext.planner.tf_profiling import ProfileExperiment
from lingvo_ext.planner.tf_profiling import ProfileLayers
from lingvo_ext.planner.tf_profiling import RssBytes
from lingvo_ext.planner.tf_profiling import SessionConfig
from lingvo_ext.planner.tf_profiling import TimeSteps
