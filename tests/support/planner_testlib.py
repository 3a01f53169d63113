"""Toy profiles, plans and machines the planner's tests share."""

from lingvo_ext import planner
from lingvo_ext.pipeline import partitioning

TINY = 'lm.TransformerLmTiny'


def Layer(name, flops=1e6, param_bytes=4096, kept=512., out=256.):
  return planner.LayerProfile(
      name=name, flops=flops, fwd_ops=4, bwd_ops=9, param_bytes=param_bytes,
      num_vars=2, out_bytes=out, kept_bytes=kept)


def Profile(num_layers=8, batch=32, linear_loss=True, **kwargs):
  return planner.ModelProfile(
      name='toy', layers=tuple(Layer('l%d' % i, **kwargs)
                               for i in range(num_layers)),
      batch=batch, in_bytes=256., optimizer_slots=2, linear_loss=linear_loss)


# Compute only: FLOPs at 1e9/s, nothing per op or per step.
FLOPS_ONLY = planner.Machine(flops_per_s=1e9, s_per_op=0., step_s=0.,
                             bytes_per_s=1e30, update_ops_per_var=0)


def Plan(k, m, schedule='unrolled', recompute=False, replicas=1,
         profile=None, devices=None):
  profile = profile or Profile()
  sizes = partitioning.MinMaxPartition([l.flops for l in profile.layers], k)
  return planner.Plan(
      num_cells=k, sizes=tuple(sizes), devices_per_replica=devices or k,
      num_micro_batches=m, schedule=schedule, recompute=recompute,
      replicas=replicas, gradient_sync='all_reduce' if replicas > 1 else
      'shared', global_batch=profile.batch)


def Machine(**kwargs):
  fields = dict(flops_per_s=1e9, s_per_op=0., step_s=0., bytes_per_s=1e30,
                update_ops_per_var=0, add_bytes_per_s=1e30)
  fields.update(kwargs)
  return planner.Machine(**fields)


def Predicted(plan, step_s=0.):
  return planner.Candidate(plan, planner.Prediction(
      step_s=step_s, bubble=0., peak_bytes=0., process_bytes=0.,
      comm_bytes=0.))


def Measured(plan, times):
  return Predicted(plan).Measured(times=times, step_s=min(times))


def BuildTask(cfg, devices, split, train=False):
  """The experiment's task on a worker of `devices` CPUs split by `split`;
  with `train`, its training step built too (task.train_op)."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  task_p = cfg.task.Copy()
  task_p.input = cfg.input.Copy()
  with tf.Graph().as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=devices, split_size=split):
    py_utils.GetOrCreateGlobalStepVar()
    task = task_p.Instantiate()
    if train:
      task.FPropDefaultTheta()
      task.BProp()
    return task
