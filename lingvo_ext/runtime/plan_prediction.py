"""The planner's prediction of the plan a run uses, for its plan check.

The run's params as the trainer built them (--plan=auto's plan set) are
profiled and their plan read off them; the machine is this host's,
calibrated on the model's real cells at the run's shapes (planner/auto.py's
Machine for a PipelinedTask, planner/tree_calibration.py for pipelines that
come cut), cached per model and machine, so a cold cache costs a
calibration once. The peak RSS is the start-up memory check's model
(start_memory.EstimateRun, planner/memory_model.py). `Start` runs it in a fresh process (forked from a server
that imported TF): neither its graphs nor its calibration count in the
trainer's own peak RSS, which the check measures. plan_check.py prints the
line.
"""

import dataclasses
import threading
from typing import Dict, List, Tuple

from lingvo_ext.runtime import plan_check

# A prediction slower than this (a calibration of a large model on a loaded
# host) gives no check, a note in the log.
TIMEOUT_S = 900.


def _StepTerms(profile, plan, machine) -> List[Tuple[str, float]]:
  """The predicted step in its parts: each constant of the machine zeroed
  in turn (what is left: hand-offs, gates, sums and their overlap)."""
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  total = planner.Predict(profile, plan, machine).step_s

  def Without(**fields):
    return planner.Predict(profile, plan,
                           dataclasses.replace(machine, **fields)).step_s

  flops = total - Without(flops_per_s=1e30)
  ops = total - Without(s_per_op=0.)
  fixed = machine.step_s
  terms = [('the FLOPs at the fitted rate (flops_per_s)', flops),
           ('the time per op (s_per_op)', ops),
           ('the fixed time of a step (step_s: session, input and the ops '
            'outside the pipeline)', fixed)]
  rest = total - flops - ops - fixed
  if rest > 0:
    terms.append(('hand-offs, gates and gradient sums', rest))
  return terms


def RecalibrateCommand(model: str, devices: int, overrides: str) -> str:
  """The command that times the model's references again."""
  text = f" --model_params_override='{overrides}'" if overrides else ''
  return (f'.venv/bin/python -m lingvo_ext.tools.plan --model={model} '
          f'--devices={devices}{text} --recalibrate')


def MemoryRecalibrateCommand(num_devices: int) -> str:
  """The command that measures the memory model's constants again."""
  return ('.venv/bin/python -m lingvo_ext.tools.memory_probe '
          f'--num_devices={max(1, num_devices)} --force')


def _PipelinedTask(model, cfg, devices, num_cpu_devices, split):
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import start_memory  # pylint: disable=g-import-not-at-top
  profile = planner.ProfileExperiment(cfg, model)
  plan = start_memory.PlanOfParams(profile, cfg.task, num_cpu_devices, split)
  machine = auto.Machine(devices, model, profile, model_params=cfg)
  got = planner.Predict(profile, plan, machine)
  return got.step_s, _StepTerms(profile, plan, machine)


def _Tree(model, cfg, devices, num_cpu_devices, split):
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tree_calibration  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import start_memory  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  pipes = tree.ProfileTree(cfg, model)
  machine = tree_calibration.Calibrate(
      model, cfg, pipes, devices,
      overhead_bytes=auto.PROCESS_OVERHEAD_BYTES)
  params = {'task.' + path: p for path, p in pipeline_tree.Pipelines(cfg.task)}
  plans = [start_memory.PlanOfPipeline(pipe, params[pipe.path],
                                       num_cpu_devices, split)
           for pipe in pipes]
  # The others' time is in the fitted fixed time (tree_calibration.py).
  step_s = planner.Predict(pipes[0].profile, plans[0], machine).step_s
  return step_s, _StepTerms(pipes[0].profile, plans[0], machine)


def EndWithParent(poll_s: float = 0.5) -> None:
  """Ends this process when its parent (the fork server, which ends with
  the trainer) is gone: a prediction never outlives the run."""
  import os  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  parent = os.getppid()

  def Watch():
    while os.getppid() == parent:
      time.sleep(poll_s)
    os._exit(0)  # pylint: disable=protected-access

  threading.Thread(target=Watch, daemon=True, name='end_with_parent').start()


def PredictJob(job: Dict) -> Dict:
  """The prediction of the run `job` describes, as Predicted.ToDict() (TF;
  runs in a fresh process).

  Args:
    job: model, overrides, file_override, engine (the trainer's flags that
      build its params), devices (planned for), num_cpu_devices, split.
  """
  from lingvo_ext.runtime import start_memory  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  EndWithParent()
  cfg = experiment_params.GetParams(job['model'], 'Train', job['overrides'],
                                    job['file_override'], job['engine'])
  how = (_PipelinedTask if pipeline_tree.IsPipelinedTask(cfg.task) else _Tree)
  step_s, step_terms = how(job['model'], cfg, job['devices'],
                           job['num_cpu_devices'], job['split'])
  # The start-up memory check's model (planner/memory_model.py).
  rss = start_memory.EstimateRun(cfg, job['num_cpu_devices'], job['split'])
  if rss is None:
    raise ValueError('the memory model reads no pipeline of the task')
  command = RecalibrateCommand(job['model'], job['devices'], job['overrides'])
  return plan_check.Predicted(
      step_s=step_s, rss_bytes=rss.rss_bytes, step_terms=tuple(step_terms),
      rss_terms=tuple((f"the '{name}' term", b)
                      for name, b in rss.rss_terms.items()),
      recalibrate=command,
      recalibrate_memory=MemoryRecalibrateCommand(
          job['num_cpu_devices'])).ToDict()


def Job(o) -> Dict:
  """PredictJob's job of the trainer's Options."""
  return dict(model=o.model, overrides=o.model_params_override,
              file_override=o.model_params_file_override,
              engine=o.gpipe_engine,
              devices=o.devices if o.plan and o.devices else o.num_cpu_devices,
              num_cpu_devices=o.num_cpu_devices, split=o.worker_split_size)


class Pending:
  """The prediction, computed in a fresh process on a thread of its own
  (beside the model's build).

  Calling it waits for it: the Predicted (False if it failed: the cause is
  in the log, or if `stop` is set meanwhile: a run told to stop does not
  wait). The trainer calls it at its first step, so that the steps the
  check measures run alone.
  """

  def __init__(self, job: Dict, timeout_s: float = TIMEOUT_S, stop=None):
    self._stop = stop
    self._result = None
    self._thread = threading.Thread(target=self._Run, args=(job, timeout_s),
                                    daemon=True, name='plan_prediction')
    self._thread.start()

  def _Run(self, job, timeout_s):
    import multiprocessing  # pylint: disable=g-import-not-at-top
    import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
    ctx = multiprocessing.get_context('forkserver')
    ctx.set_forkserver_preload(['lingvo_ext.planner'])
    try:
      with ctx.Pool(1, maxtasksperchild=1) as pool:
        got = pool.apply_async(PredictJob, (job,)).get(timeout_s)
      self._result = plan_check.Predicted.FromDict(got)
      tf.logging.info('plan check: predicted %s', got)
    except Exception as e:  # pylint: disable=broad-except
      # A check's prediction never stops the run it checks.
      tf.logging.info('plan check: no prediction: %s: %s',
                      type(e).__name__, e)
      self._result = False

  def __call__(self):
    while self._thread.is_alive():
      if self._stop is not None and self._stop.is_set():
        return False
      self._thread.join(0.2)
    return self._result


def Start(o, max_steps, stop=None) -> 'plan_check.PlanCheck':
  """The trainer's PlanCheck (--plan_check_steps, --plan_check_secs), its
  prediction started; None if the run is too short for a check (or
  --plan_check_steps=0). `stop`: an Event that ends the wait for it (the
  run's RunState.interrupted)."""
  from lingvo_ext.planner import memory_probe  # pylint: disable=g-import-not-at-top
  steps = o.plan_check_steps
  if steps <= 0 or (max_steps is not None and max_steps < steps):
    return None
  if memory_probe.InProbe():
    return None  # The memory model's own probe runs: it has no model yet.
  summary_dir = _SummaryDir(o)
  return plan_check.PlanCheck(
      Pending(Job(o), stop=stop),
      plan_check.Thresholds(steps, o.plan_check_secs),
      emit=lambda lines, scalars, step: plan_check.Emit(
          lines, scalars, step, summary_dir=summary_dir))


def _SummaryDir(o) -> str:
  import os  # pylint: disable=g-import-not-at-top
  return os.path.join(o.logdir, 'train') if o.logdir else ''
