"""The planner's prediction of the plan a run uses, for its plan check.

The run's params as the trainer built them (--plan=auto's plan set) are
profiled and their plan read off them; the machine is this host's,
calibrated on the model's real cells at the run's shapes (planner/auto.py's
Machine for a PipelinedTask, planner/tree_calibration.py for pipelines that
come cut), each reference's median step, on the trainer's intra-op threads,
cached per model and machine, so a cold cache costs a calibration once. The
trainer loop's own time per step (loop_overhead.py) is added. The peak RSS
is the start-up memory check's model (start_memory.EstimateRun,
planner/memory_model.py). `Start` runs it in a fresh process (forked from a
server that imported TF) while the run trains: neither its graphs nor its
calibration count in the trainer's own peak RSS, which the check measures.
plan_check.py prints the line.
"""

import dataclasses
import threading
from typing import Dict
from typing import List
from typing import Tuple

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


def _PipelinedTask(model, cfg, devices, num_cpu_devices, split,
                   on_calibrate=None):
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.preflight import start_memory  # pylint: disable=g-import-not-at-top
  profile = planner.ProfileExperiment(cfg, model)
  plan = start_memory.PlanOfParams(profile, cfg.task, num_cpu_devices, split)
  machine = auto.Machine(devices, model, profile, model_params=cfg,
                         on_calibrate=on_calibrate)
  got = planner.Predict(profile, plan, machine)
  return got.step_s, _StepTerms(profile, plan, machine)


def _Tree(model, cfg, devices, num_cpu_devices, split, on_calibrate=None):
  from lingvo_ext import planner  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import auto  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tree_calibration  # pylint: disable=g-import-not-at-top
  from lingvo_ext.preflight import start_memory  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  pipes = tree.ProfileTree(cfg, model)
  machine = tree_calibration.Calibrate(
      model, cfg, pipes, devices,
      overhead_bytes=auto.PROCESS_OVERHEAD_BYTES, on_calibrate=on_calibrate)
  params = {'task.' + path: p for path, p in pipeline_tree.Pipelines(cfg.task)}
  plans = [start_memory.PlanOfPipeline(pipe, params[pipe.path],
                                       num_cpu_devices, split)
           for pipe in pipes]
  # The others' time is in the fitted fixed time (tree_calibration.py).
  step_s = planner.Predict(pipes[0].profile, plans[0], machine).step_s
  return step_s, _StepTerms(pipes[0].profile, plans[0], machine)


def QuietWorker() -> None:
  """A prediction's worker prints nothing on the run's console: its result
  or error goes back to the trainer, which logs it, and a trainer that ended
  first (a finished or failed run) leaves it nothing to say."""
  import os  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  sys.stderr = open(os.devnull, 'w', encoding='utf-8')  # pylint: disable=consider-using-with


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


def TrainersThreadPool(threads: int, num_devices: int) -> None:
  """This process's intra-op pool sized as the trainer's (the first
  session's config makes it for the process): the references are timed on
  the threads the run's steps get, not on every core."""
  if not threads:
    return
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  config = tf.config_pb2.ConfigProto(intra_op_parallelism_threads=threads,
                                     device_count={'CPU': max(1, num_devices)})
  with tf.Graph().as_default():
    tf.Session(config=config).close()


def PredictJob(job: Dict) -> Dict:
  """The prediction of the run `job` describes, as Predicted.ToDict() (TF;
  runs in a fresh process).

  Args:
    job: model, overrides, file_override, engine (the trainer's flags that
      build its params), devices (planned for), num_cpu_devices, split;
      optionally calibrating: a path created when the cache is cold and the
      references are timed (the trainer holds its steps meanwhile), and
      intra_op_threads: the trainer's (Options.IntraOpThreads).
  """
  from lingvo_ext.preflight import start_memory  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import loop_overhead  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
  EndWithParent()
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    # Lingvo's task code reads its flags' defaults (e.g. the MT model's
    # --tflite_compatible); this process parsed no command line.
    flags.FLAGS.mark_as_parsed()
  TrainersThreadPool(job.get('intra_op_threads', 0), job['num_cpu_devices'])
  cfg = experiment_params.GetParams(job['model'], 'Train', job['overrides'],
                                    job['file_override'], job['engine'])
  how = (_PipelinedTask if pipeline_tree.IsPipelinedTask(cfg.task) else _Tree)
  flag = job.get('calibrating')
  step_s, step_terms = how(
      job['model'], cfg, job['devices'], job['num_cpu_devices'], job['split'],
      on_calibrate=(lambda: open(flag, 'w').close()) if flag else None)
  # The trainer loop's own time per step, probed now (loop_overhead.py).
  loop = loop_overhead.Seconds(job['num_cpu_devices'])
  step_s += loop
  step_terms = list(step_terms) + [(plan_check.PROBED_LOOP_TERM, loop)]
  # The start-up memory check's model (planner/memory_model.py).
  rss = start_memory.EstimateRun(cfg, job['num_cpu_devices'], job['split'])
  if rss is None:
    raise ValueError('the memory model reads no pipeline of the task')
  command = RecalibrateCommand(job['model'], job['devices'], job['overrides'])
  return plan_check.Predicted(
      step_s=step_s, rss_bytes=rss.rss_bytes, step_terms=tuple(step_terms),
      loop_s=loop,
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
              num_cpu_devices=o.num_cpu_devices, split=o.worker_split_size,
              intra_op_threads=o.IntraOpThreads())


class Pending:
  """The prediction, computed in a fresh process on a thread of its own
  (beside the model's build and the first steps).

  Calling it gives the Predicted, False if it failed (the cause is in the
  log), None while it runs: training does not wait for it, the check's
  steps are counted from its arrival. Only while a cold cache's references
  are timed does a call wait (they would time the run's steps, not their
  own), until the prediction is in or `stop` is set (then False: a run told
  to stop does not wait).
  """

  def __init__(self, job: Dict, timeout_s: float = TIMEOUT_S, stop=None):
    import os  # pylint: disable=g-import-not-at-top
    import tempfile  # pylint: disable=g-import-not-at-top
    self._stop = stop
    self._result = None
    fd, self._calibrating = tempfile.mkstemp(prefix='plan_calibrating.')
    os.close(fd)
    os.unlink(self._calibrating)  # The child creates it on a cache miss.
    job = dict(job, calibrating=self._calibrating)
    self._thread = threading.Thread(target=self._Run, args=(job, timeout_s),
                                    daemon=True, name='plan_prediction')
    self._thread.start()

  def _Run(self, job, timeout_s):
    import multiprocessing  # pylint: disable=g-import-not-at-top

    import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
    ctx = multiprocessing.get_context('forkserver')
    ctx.set_forkserver_preload(['lingvo_ext.planner'])
    try:
      with ctx.Pool(1, maxtasksperchild=1, initializer=QuietWorker) as pool:
        got = pool.apply_async(PredictJob, (job,)).get(timeout_s)
      self._result = plan_check.Predicted.FromDict(got)
      tf.logging.info('plan check: predicted %s', got)
    except Exception as e:  # pylint: disable=broad-except
      # A check's prediction never stops the run it checks.
      tf.logging.info('plan check: no prediction: %s: %s',
                      type(e).__name__, e)
      self._result = False
    finally:
      _Remove(self._calibrating)

  def Calibrating(self) -> bool:
    """Whether the child times the references of a cold cache now."""
    import os  # pylint: disable=g-import-not-at-top
    return self._thread.is_alive() and os.path.exists(self._calibrating)

  def Wait(self):
    """The prediction, waiting for it (until the run's stop event)."""
    while self._thread.is_alive():
      if self._stop is not None and self._stop.is_set():
        return False
      self._thread.join(0.2)
    return self._result

  def __call__(self):
    if self._thread.is_alive() and not self.Calibrating():
      return None
    while self._thread.is_alive():
      if self._stop is not None and self._stop.is_set():
        return False
      self._thread.join(0.2)
    return self._result


def _Remove(path: str) -> None:
  import os  # pylint: disable=g-import-not-at-top
  try:
    os.unlink(path)
  except OSError:
    pass


def Start(o, max_steps, stop=None, emit=None,
          rss=None) -> 'plan_check.PlanCheck':
  """The trainer's PlanCheck (--plan_check_steps, --plan_check_secs), its
  prediction started; None if the run is too short for a check (or
  --plan_check_steps=0). `stop`: an Event that ends the wait for it (the
  run's RunState.interrupted); `emit`, `rss`: PlanCheck's (default: to the
  console, the log and LOGDIR/train; this process's peak RSS)."""
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
      emit=emit or (lambda lines, scalars, step: plan_check.Emit(
          lines, scalars, step, summary_dir=summary_dir)),
      rss=rss or plan_check.PeakRss)


def _SummaryDir(o) -> str:
  import os  # pylint: disable=g-import-not-at-top
  return os.path.join(o.logdir, 'train') if o.logdir else ''
