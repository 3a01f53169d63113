"""The planner's TensorFlow half: profiles a model, probes and times the machine.

Each function imports TensorFlow (and Lingvo) only when called, so that the
pure-Python modules of the planner need none.
"""

import math
import os
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo_ext import child_peak
from lingvo_ext.planner.application import ApplyPlan
from lingvo_ext.planner.model_profile import OPTIMIZER_SLOTS
from lingvo_ext.planner.model_profile import LayerProfile
from lingvo_ext.planner.model_profile import Machine
from lingvo_ext.planner.model_profile import ModelProfile
from lingvo_ext.planner.plans import Plan
from lingvo_ext.planner.plans import PlanFromDict

# Ops that move no data of their own (aliases, constants, checks).
_FREE_OPS = frozenset(['Const', 'Identity', 'IdentityN', 'NoOp', 'Assert',
                       'EnsureShape', 'ReadVariableOp', 'StopGradient',
                       'Placeholder', 'PreventGradient'])


def _IsCounted(op) -> bool:
  """Whether op computes on floats (shape arithmetic is folded away)."""
  return op.type not in _FREE_OPS and any(
      t.dtype.is_floating for t in op.outputs)


def Source(t):
  """The tensor t aliases through Identity-like ops."""
  while t.op.type in ('Identity', 'EnsureShape', 'StopGradient') and (
      t.op.inputs):
    t = t.op.inputs[0]
  return t


def _LayerGraphStats(p, shapes) -> Tuple[int, int, float]:
  """(forward ops, backward ops, kept bytes) of layer p on inputs of shapes (TF).

  Builds the layer's FProp and its tf.gradients in a throw-away graph (nothing
  runs). Ops are those computing on floats (`_IsCounted`). The kept bytes are
  those of the tensors the layer's forward pass makes (not its inputs or
  weights, through Identity aliases) that its backward ops read: the
  activations a pipeline keeps between a cell's 'F' and its 'B'.
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  from lingvo_ext.pipeline import cost  # pylint: disable=g-import-not-at-top
  with cost.Sandbox() as g:
    layer = cost.InstantiateLayer(cost.NamedCopy(p, 'layer'))
    theta = layer.theta.Transform(tf.identity)
    inputs = [tf.identity(t) for t in cost.FakeInputs(p, shapes)]
    n0 = len(g.get_operations())
    outs = layer.FProp(theta, *inputs)
    outs = [o for o in tf.nest.flatten(outs)
            if o is not None and o.dtype.is_floating]
    fwd = g.get_operations()[n0:]
    loss = tf.add_n([tf.reduce_sum(o) for o in outs])
    n1 = len(g.get_operations())
    xs = theta.Flatten() + [x for x in inputs if x.dtype.is_floating]
    tf.gradients(loss, xs)
    bwd = g.get_operations()[n1:]
  return CountedOps(fwd), CountedOps(bwd), KeptBytes(fwd, bwd)


def CountedOps(ops) -> int:
  """How many of `ops` compute on floats (`_IsCounted`)."""
  return sum(map(_IsCounted, ops))


def KeptBytes(fwd, bwd) -> float:
  """Bytes of the tensors forward ops `fwd` make that backward ops `bwd`
  read (through Identity aliases): what is kept between 'F' and 'B'."""
  fwd_set = set(fwd)
  kept = {}
  for op in bwd:
    for t in op.inputs:
      t = Source(t)
      if t.op in fwd_set and t.shape.is_fully_defined():
        kept[t.name] = t.shape.num_elements() * t.dtype.size
  return float(sum(kept.values()))


def ProfileLayers(layer_params: Sequence, *shapes) -> List[LayerProfile]:
  """The LayerProfile of each layer of a sequential stack at `shapes` (TF).

  FLOPs and output shapes from FPropMeta (`cost.LayerMetas`), parameter bytes
  from the layer's variables (`cost.LayerVariables`), op counts and kept
  activation bytes from its graph (built, never run). Identical layers are
  profiled once. All per-example figures divide by the batch of `shapes`.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lingvo_ext.pipeline import cost  # pylint: disable=g-import-not-at-top
  metas = cost.LayerMetas(layer_params, *shapes)
  batch = int(shapes[0].ToTensorShape().as_list()[0])
  cache = {}
  out = []
  for p, meta in zip(layer_params, metas):
    key = (p.Copy().Set(name='x').ToText(),
           tuple(str(s) for s in meta.in_shapes))
    if key not in cache:
      variables = cost.LayerVariables(p)
      fwd_ops, bwd_ops, kept = _LayerGraphStats(p, meta.in_shapes)
      cache[key] = (
          int(sum(int(np.prod(s)) * d.size for _, s, d in variables)),
          len(variables), fwd_ops, bwd_ops, kept)
    param_bytes, num_vars, fwd_ops, bwd_ops, kept = cache[key]
    out_bytes = cost.ActivationBytes(meta.out_shapes) / batch
    out.append(LayerProfile(
        name=p.name, flops=float(meta.flops) / batch, fwd_ops=fwd_ops,
        bwd_ops=bwd_ops, param_bytes=param_bytes, num_vars=num_vars,
        out_bytes=out_bytes, kept_bytes=max(kept / batch, out_bytes)))
  return out


def OptimizerSlots(task_params) -> int:
  """Slot variables per parameter of the task's optimizer."""
  return OPTIMIZER_SLOTS.get(task_params.train.optimizer.cls.__name__, 2)


def ProfileExperiment(model_params, name: str = '') -> ModelProfile:
  """The ModelProfile of a registered experiment's params (TF).

  Args:
    model_params: `model_registry.GetParams(name, 'Train')` (overrides
      applied), whose task is a `PipelinedTask`.
    name: The experiment's name, for messages.
  """
  task = model_params.task.Copy()
  task.input = model_params.input.Copy()
  stack, shapes = task.cls.LayerStack(task)
  in_shape = shapes[0].ToTensorShape().as_list()
  batch = int(in_shape[0])
  in_bytes = 4. * math.prod(in_shape[1:])  # States between cells: float32.
  return ModelProfile(
      name=name or task.name, layers=tuple(ProfileLayers(stack, *shapes)),
      batch=batch, in_bytes=in_bytes, optimizer_slots=OptimizerSlots(task),
      linear_loss=False,
      cell_functions=bool(task.Get('cell_functions')
                          if 'cell_functions' in task else True))


def ProbeMachine(session_config=None, cores: Optional[float] = None,
                 overhead_bytes: float = 0.) -> Machine:
  """Machine with this host's FLOP rate, per-op time and parallelism (TF).

  Times a chain of small elementwise ops (the per-op cost) and a chain of
  matmuls (the FLOP rate) in a throw-away session, and two such matmul
  chains on two devices at once: how much faster than one after the other
  they run is how many devices compute at once (CPU devices share the
  host's cores, and other processes take their share). The small chain
  again with each op on the other device than the op before it gives the
  time of a hand-off between devices, and gated as the engine gates
  enforced actions the time of a gate; a chain of adds of 1 MB tensors the
  rate of a gradient sum (`Machine.add_bytes_per_s`). A few seconds.

  Args:
    session_config: The tf.ConfigProto the model will run under.
    cores: Devices that compute at once; default: measured as above.
    overhead_bytes: See Machine.
  """
  import statistics  # pylint: disable=g-import-not-at-top

  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  n_ops, dim, n_mm = 300, 384, 4
  g = tf.Graph()
  with g.as_default():
    x = tf.Variable(np.ones([8, 8], np.float32))
    y = tf.identity(x)
    for _ in range(n_ops):
      y = tf.tanh(y)  # Nothing for Grappler to fold.
    small = tf.reduce_sum(y)
    empty = tf.reduce_sum(x)
    chains = []
    for d in range(2):
      with tf.device('/cpu:%d' % d):
        a = tf.Variable(
            np.random.RandomState(d).rand(dim, dim).astype(np.float32))
        z = tf.identity(a)
        for _ in range(n_mm):
          z = tf.matmul(z, a) * (1. / dim)
        chains.append(tf.reduce_sum(z))
    big = chains[0]
    both = tf.add_n(chains)
    init = tf.global_variables_initializer()

  def Median(sess, fetch):
    return statistics.median(TimeSteps(lambda: sess.run(fetch), 7, 1))

  # Engine overheads, in a graph Grappler leaves as built (it would fold
  # the hops and gates away, and turn the chain of adds into one AddN): the
  # small chain again, each op on the other device than the one before it
  # (a hand-off, Send/Recv, per op), and each op gated as the list engines
  # gate an action (a NoOp gate waiting for the previous op's completion);
  # and a chain of adds of layer-sized (1 MB) tensors, as gradients are
  # accumulated over micro-batches: the rate of bytes an add moves.
  n_add, add_dim = 20, 512
  g2 = tf.Graph()
  with g2.as_default():
    x2 = tf.Variable(np.ones([8, 8], np.float32))
    y = tf.identity(x2)
    for _ in range(n_ops):
      y = tf.tanh(y)
    plain = tf.reduce_sum(y)
    y = tf.identity(x2)
    for i in range(n_ops):
      with tf.device('/cpu:%d' % (i % 2)):
        y = tf.tanh(y)
    hops = tf.reduce_sum(y)
    y = tf.identity(x2)
    done = None
    for _ in range(n_ops):
      with tf.control_dependencies([done] if done is not None else []):
        gate = tf.no_op()
      with tf.control_dependencies([gate]):
        y = tf.tanh(y)
      done = tf.group(y)
    with tf.control_dependencies([done]):
      gated = tf.reduce_sum(y)
    u = tf.Variable(np.ones([add_dim, add_dim], np.float32))
    v = tf.Variable(np.ones([add_dim, add_dim], np.float32))
    z = tf.identity(u)
    for _ in range(n_add):
      z = z + v
    adds = z[0, 0]
    one_add = (u + v)[0, 0]
    init2 = tf.global_variables_initializer()

  config = tf.config_pb2.ConfigProto()
  if session_config is not None:
    config.CopyFrom(session_config)
  config.device_count['CPU'] = max(2, config.device_count['CPU'])
  config.allow_soft_placement = True
  with tf.Session(graph=g, config=config) as sess:
    sess.run(init)
    base = Median(sess, empty)
    s_per_op = max(Median(sess, small) - base, 1e-7) / n_ops
    one = Median(sess, big)
    two = Median(sess, both)
  raw = tf.config_pb2.ConfigProto()
  raw.CopyFrom(config)
  raw.graph_options.rewrite_options.disable_meta_optimizer = True
  with tf.Session(graph=g2, config=raw) as sess:
    sess.run(init2)
    chain = Median(sess, plain)
    s_per_handoff = max(Median(sess, hops) - chain, 0.) / n_ops
    s_per_gate = max(Median(sess, gated) - chain, 0.) / n_ops
    add_s = max(Median(sess, adds) - Median(sess, one_add), 1e-9) / (
        n_add - 1)
  add_bytes_per_s = 3. * 4 * add_dim**2 / add_s  # Two read, one written.
  mm = max(one - base - n_mm * 2 * s_per_op, 1e-7)
  flops_per_s = n_mm * 2. * dim**3 / mm
  if cores is None:
    cores = min(max(2. * one / max(two, 1e-9), 1.), float(os.cpu_count() or 1))
  return Machine(flops_per_s=flops_per_s, s_per_op=s_per_op, cores=cores,
                 step_s=base, overhead_bytes=overhead_bytes,
                 add_bytes_per_s=add_bytes_per_s, s_per_handoff=s_per_handoff,
                 s_per_gate=s_per_gate)


def ExperimentParams(model: str, dataset: str = 'Train',
                     overrides: str = ''):
  """A registered experiment's params (TF), `overrides` (a
  --model_params_override text) applied; ValueError naming close names."""
  from lingvo_ext import registry  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  error = registry.CheckModel(model)
  if error:
    raise ValueError(error)
  return experiment_params.GetParams(model, dataset, overrides)


def SessionConfig(num_devices: int):
  """The trainer's session config (distributed.server's), N CPU devices."""
  from lingvo_ext import session_config  # pylint: disable=g-import-not-at-top
  return session_config.LocalSessionConfig(num_devices)


def RssBytes(field: str = 'VmHWM') -> Optional[float]:
  """This process's peak (VmHWM) or current (VmRSS) resident set, bytes."""
  got = child_peak.StatusBytes(field)
  return None if got is None else float(got)


def BuildExperimentStep(model: str, plan: Plan, overrides: str = '',
                        model_params=None, apply=None):
  """(session, train op) of the experiment under `plan` (TF).

  As the trainer builds it: the experiment's params with `overrides` (the
  user's --model_params_override; or a copy of `model_params`, built with
  them) and the plan's, its task on a local worker of plan.devices CPU
  devices split into replicas of plan.devices_per_replica, the trainer's
  session config. `apply(params, plan)` sets the plan (default ApplyPlan;
  tree_calibration's sets it on a pipeline that comes cut).
  """
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  py_utils.SetEagerMode(False)
  cfg = (apply or ApplyPlan)(ExperimentParams(model, overrides=overrides)
                             if model_params is None else
                             model_params.Copy(), plan)
  task_p = cfg.task.Copy()
  task_p.input = cfg.input.Copy()
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=plan.devices,
      split_size=plan.devices_per_replica)
  cluster.params.ps.cpus_per_replica = plan.devices
  graph = tf.Graph()
  with graph.as_default(), cluster:
    tf.random.set_seed(1234)
    py_utils.GetOrCreateGlobalStepVar()
    task = task_p.Instantiate()
    task.FPropDefaultTheta()
    task.BProp()
    train_op = task.train_op
    init = [tf.global_variables_initializer(),
            tf.local_variables_initializer()]
  sess = tf.Session(graph=graph, config=SessionConfig(plan.devices))
  sess.run(init)
  return sess, train_op


def TimeSteps(run, steps: int, warmup: int) -> List[float]:
  """Seconds of `steps` calls of run() after `warmup` untimed ones."""
  import time  # pylint: disable=g-import-not-at-top
  for _ in range(warmup):
    run()
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    run()
    times.append(time.perf_counter() - t)
  return times


def MeasureJob(job: Dict) -> Dict:
  """One plan's median step seconds and peak RSS bytes (TF; run it in a
  fresh process so that the RSS is the plan's own).

  Args:
    job: model, plan (Plan.ToDict()), steps, warmup, and optionally
      overrides (a --model_params_override text).
  """
  import statistics  # pylint: disable=g-import-not-at-top
  plan = PlanFromDict(job['plan'])
  sess, train_op = BuildExperimentStep(job['model'], plan,
                                       job.get('overrides', ''))
  times = TimeSteps(lambda: sess.run(train_op), job['steps'], job['warmup'])
  sess.close()
  return dict(step_s=statistics.median(times), times=times,
              rss_bytes=RssBytes('VmHWM'))
