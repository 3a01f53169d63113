"""The process's peak RSS, predicted: what a cgroup limit or the OOM killer
sees (pure Python).

`Predict` adds named terms (`RssEstimate.terms`, in bytes, their sum the
total):

- runtime: TensorFlow's and Lingvo's own resident set once a session on the
  run's devices has run a step (measured: `Constants.runtime_bytes`);
- variables, gradients, optimizer_slots: the parameters, a gradient of each
  and the optimizer's slots (`ModelProfile.optimizer_slots` per parameter);
- activations: what the schedule keeps alive on each device (the planner's
  per-device peak in flight, by micro-batch, recompute and the loss's
  place: prediction.Predict), times `Constants.activation_factor`, the
  allocator's bytes per byte of kept tensor (measured);
- transient: the step's passing peak beyond them: the gradients of the
  largest layer's kept activations of one micro-batch while its backward
  pass runs, times the same factor;
- gradient_buffers: the weight gradients a schedule computes per
  micro-batch (or per run of them) before they are summed
  (prediction.Accumulations: recompute's 'B' actions, 1F1B's runs), held
  to the step's sum, times the factor;
- recompute_outputs: with recompute, every layer's output of every
  micro-batch, alive from the forward pass to the backward one (measured:
  bench/memory.py's recompute rows fall short by this without it), times
  the factor;
- input_pipeline: the batches the input holds (the one in the step and the
  next, INPUT_BATCHES);
- input_buffer: the records a Lingvo record input's shuffle buffer holds
  (planner/input_memory.py: min(file_buffer_size, the files' records) of
  the files' mean record); 0 here, added by the start check from the
  input params (start_memory.EstimateRun);
- graph: the training graph's nodes (its ops and its functions' nodes, as
  the trainer builds them: `GraphNodes`, from the planner's op count; the
  tree path counts them on the built graph, tree_memory.TrainingGraphNodes)
  times `Constants.bytes_per_op`: what the runtime holds per node while it
  prepares the first step (optimized, partitioned and instantiated per
  device), the step's largest transient beyond its tensors.

The constants come from `memory_probe` (a short run on this machine, cached
per machine, TensorFlow version and device count); docs/performance.md,
"Memory".
"""

import dataclasses
from typing import Dict
from typing import Tuple

from lingvo_ext import devices
from lingvo_ext.pipeline import records
from lingvo_ext.planner import prediction
from lingvo_ext.planner.model_profile import ModelProfile
from lingvo_ext.planner.plans import Plan

# The input pipeline's batches in memory at once: the step's and the one
# being read meanwhile.
INPUT_BATCHES = 2
TERM_NAMES = ('runtime', 'variables', 'gradients', 'optimizer_slots',
              'activations', 'transient', 'gradient_buffers',
              'recompute_outputs', 'input_pipeline', 'input_buffer',
              'graph')
# The built training graph's nodes (its ops and its functions' nodes) per
# op the planner counts (prediction.GraphOps: ops computing on floats), per
# variable (its initializer, reads, gradient sum, optimizer update, slots)
# and besides (global step, input, summaries): fitted on the bundled LMs'
# built graphs, with and without cell functions, 1 to 8 micro-batches
# (tests/planner/test_memory_graph.py holds them).
NODES_PER_OP = 1.5
NODES_PER_VARIABLE = 56
NODES_BASE = 400
# The terms the probe's activation factor scales.
SCALED_TERMS = ('activations', 'transient', 'gradient_buffers',
                'recompute_outputs')


@dataclasses.dataclass(frozen=True)
class Constants:
  """This machine's memory costs (memory_probe measures them).

  Attributes:
    runtime_bytes: The peak RSS of a process that imported TensorFlow and
      Lingvo and ran a step of a tiny model on the run's devices.
    activation_factor: Resident bytes per byte of kept activation (the
      allocator's rounding and pools, the backward pass's copies).
    bytes_per_op: Resident bytes per node of the training graph (its ops
      and its functions' nodes: GraphNodes, tree_memory.TrainingGraphNodes).
    source: Where the figures come from (the probe's cache key, or 'given').
  """
  runtime_bytes: float
  activation_factor: float
  bytes_per_op: float
  source: str = 'given'

  def ToDict(self) -> Dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RssEstimate:
  """A predicted peak RSS and its terms.

  Attributes:
    terms: (name, bytes) in TERM_NAMES order; they add up to rss_bytes.
    peak_device_bytes: The fullest device's model bytes (no runtime).
  """
  terms: Tuple[Tuple[str, float], ...]
  peak_device_bytes: float = 0.

  @property
  def rss_bytes(self) -> float:
    return float(sum(b for _, b in self.terms))

  def Terms(self) -> Dict[str, float]:
    """name -> bytes."""
    return dict(self.terms)

  def Plus(self, other: 'RssEstimate') -> 'RssEstimate':
    """Both estimates' model terms summed, the runtime counted once (two
    pipelines of one process)."""
    a, b = self.Terms(), other.Terms()
    terms = tuple((n, a.get(n, 0.) + (0. if n == 'runtime' else b.get(n, 0.)))
                  for n in TERM_NAMES)
    return RssEstimate(terms, max(self.peak_device_bytes,
                                  other.peak_device_bytes))


def GraphNodes(profile: ModelProfile, plan: Plan) -> float:
  """The nodes of the plan's training graph, predicted from the planner's
  op count (prediction.GraphOps) and the variables."""
  return (NODES_PER_OP * prediction.GraphOps(profile, plan) +
          NODES_PER_VARIABLE * profile.num_vars + NODES_BASE)


def ModelTerms(profile: ModelProfile, plan: Plan) -> Dict[str, float]:
  """The plan's bytes before the measured constants: parameters and their
  copies, the kept activations, the transient ones, the input and the
  training graph's nodes (key 'graph_nodes')."""
  bare = prediction.Machine(overhead_bytes=0., bytes_per_op=0.)
  got = prediction.Predict(profile, plan, bare)
  params = float(profile.param_bytes)
  weights = params * (2 + profile.optimizer_slots)
  r = plan.replicas
  mb = plan.replica_batch // plan.num_micro_batches
  stages = prediction.Stages(profile, plan.sizes)
  adds = prediction.Accumulations(plan,
                                  prediction.WeightGradientRun(plan, stages))
  outputs = 0.
  if plan.recompute and not records.Get(plan.schedule).planner.lingvo_loop:
    outputs = sum(l.out_bytes for l in profile.layers) * plan.replica_batch
  return {
      'params': params,
      # Each replica's gradients: one per variable per replica.
      'gradients': params * r,
      'optimizer_slots': params * profile.optimizer_slots,
      'activations': max(got.process_bytes - r * weights, 0.),
      'transient': max(l.kept_bytes for l in profile.layers) * mb * r,
      'gradient_buffers': params * adds * r,
      'recompute_outputs': outputs * r,
      'input_pipeline': (INPUT_BATCHES * profile.in_bytes *
                         plan.global_batch),
      'graph_nodes': float(GraphNodes(profile, plan)),
      'peak_device': got.peak_bytes,
  }


def Predict(profile: ModelProfile, plan: Plan,
            constants: Constants) -> RssEstimate:
  """The process's predicted peak RSS under `plan`, by term."""
  m = ModelTerms(profile, plan)
  f = constants.activation_factor
  terms = (('runtime', constants.runtime_bytes),
           ('variables', m['params']),
           ('gradients', m['gradients']),
           ('optimizer_slots', m['optimizer_slots']),
           ('activations', f * m['activations']),
           ('transient', f * m['transient']),
           ('gradient_buffers', f * m['gradient_buffers']),
           ('recompute_outputs', f * m['recompute_outputs']),
           ('input_pipeline', m['input_pipeline']),
           ('input_buffer', 0.),
           ('graph', m['graph_nodes'] * constants.bytes_per_op))
  return RssEstimate(terms, m['peak_device'])


def Extra(estimate: RssEstimate, name: str, num_bytes: float) -> RssEstimate:
  """`estimate` with `num_bytes` more in term `name` (variables outside a
  pipeline, for one)."""
  terms = tuple((n, b + (num_bytes if n == name else 0.))
                for n, b in estimate.terms)
  return RssEstimate(terms, estimate.peak_device_bytes)


def DefaultRecompute(record, linear_loss: bool) -> bool:
  """What recompute=None means for a schedule (records.Schedule)."""
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  return record.recompute == records.ALWAYS or (
      record.recompute == records.WHEN_NEEDED and not linear_loss)


def PlanOfParams(profile, task, num_cpu_devices: int, split: int):
  """The planner's Plan of the task's params on the trainer's devices."""
  from lingvo_ext.pipeline import partitioning  # pylint: disable=g-import-not-at-top
  from lingvo_ext.pipeline import records  # pylint: disable=g-import-not-at-top
  k = min(task.num_partitions, len(profile.layers))
  costs = [l.param_bytes if task.partition_cost == 'params' else l.flops
           for l in profile.layers]
  recompute = task.recompute
  if recompute is None:
    recompute = DefaultRecompute(records.Get(task.schedule),
                                  profile.linear_loss)
  replicas = devices.Replicas(num_cpu_devices, split)
  return Plan(
      num_cells=k, sizes=tuple(partitioning.MinMaxPartition(costs, k)),
      devices_per_replica=max(1, min(split, k)),
      num_micro_batches=task.num_micro_batches, schedule=task.schedule,
      recompute=bool(recompute), replicas=replicas,
      gradient_sync=task.gradient_sync,
      global_batch=profile.batch * replicas)
