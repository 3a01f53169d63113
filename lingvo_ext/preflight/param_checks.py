"""The trainer's checks of the experiment's params, before the logdir.

Run on the params the trainer built once (run_params.RunParams), before
anything is written: a bad param is one `error:` line and exit 2.
"""

import dataclasses

from lingvo_ext import devices
from lingvo_ext.distributed import sync
from lingvo_ext.preflight import start_memory
from lingvo_ext.tasks import run_params


def Check(o, params=None):
  """Applies the overrides to the experiment's params, and checks them.

  Any experiment holding a pipeline (lingvo_ext's PipelinedTask, or a
  PipeliningLayer anywhere in its params, e.g. Lingvo's GPipeTransformerLm)
  gets the checks its layers make when built, here, before the logdir is
  touched; and with bf16 the warning and the work-around.

  Args:
    o: The options.
    params: The run's RunParams, its training params built (and planned);
      None: built here.

  Returns:
    (an error or None, the options with what the params decide).
  """
  from lingvo_ext.core import precision  # pylint: disable=g-import-not-at-top
  from lingvo_ext.preflight import dataset_checks  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  try:
    params = params or run_params.RunParams(o)
    cfg = params.Train()
    task = cfg.task if 'task' in cfg else None
    batch = (cfg.input.batch_size if 'input' in cfg and cfg.input is not None
             and 'batch_size' in cfg.input else None)
    local_training = o.run_locally == 'cpu' and o.trains_here
    split = o.worker_split_size
    replicas = devices.Replicas(o.num_cpu_devices, split)
    if task is not None and pipeline_tree.IsPipelinedTask(task):
      task.cls.CheckParams(task)
      pipelined = True
      if batch and local_training:
        # The check the task makes when built, before the logdir is touched.
        sync.CheckReplicas(task.name, task.gradient_sync, replicas,
                           split, batch, task.num_micro_batches)
    else:
      pipelined = bool(pipeline_tree.CheckPipelines(cfg, replicas))
    refusal = pipeline_tree.ScheduleRefusal(cfg, split, o.gpipe_engine)
    if refusal:
      raise ValueError(refusal)
    dataset_checks.CheckJobs(
        o.jobs, o.trains_here,
        params.Dataset, replicas)
    if pipelined and task is not None and 'fprop_dtype' in task:
      precision.WarnIfSlow(task.fprop_dtype)
      if precision.RemapperOff(task.fprop_dtype):  # A TF bug with bf16.
        o = dataclasses.replace(o, grappler_remapping=False)
  except (ValueError, AttributeError, LookupError) as e:
    return str(getattr(e, 'message', e)).strip().split('\n')[0], o
  if local_training and not o.plan:  # --plan=auto warns with its own.
    line = start_memory.WarnAtStart(cfg, o.num_cpu_devices, split,
                                    o.model_params_override)
    if line:
      o = dataclasses.replace(o, start_warning=line)
  return None, o
