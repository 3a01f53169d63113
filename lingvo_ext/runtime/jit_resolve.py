"""XLA's 'auto' resolved before the model is built: each pipeline a bool.

A pipeline whose `jit_compile` is 'auto' (the trainer's --jit_compile=auto
for a long run, runtime/jit_default.py, or the experiment's own) takes the
faster of its two builds on this machine. Its inputs' shapes are known only
from the task's forward pass, so the task is built once in a throw-away
graph (eval, one device: each pipeline runs its cells in turn and its
capture hook sees its inputs, as the planner profiles them); each pipeline
is then looked up in jit_choice's cache or, on a miss, timed
(runtime/jit_measure.py) in a fresh process forked from a server, so that
the trainer's process holds none of the timing's graphs. `Resolve` sets the
bools in the params (in place) before any runner builds the model; the
layer's FProp never measures. docs/performance.md, "XLA".
"""

import pickle
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import lingvo.compat as tf

from lingvo_ext.core import jit_choice
from lingvo_ext.runtime import jit_default
from lingvo_ext.tasks import pipeline_tree

# The longest the timing may take (a large model on a loaded host); past it
# the pipelines build without XLA, with a line in the log.
TIMEOUT_S = 1800.


def Autos(cfg) -> List[Tuple[str, object, str]]:
  """[(override path, params holding it, the pipeline's path in the task)]
  of each jit_compile that is 'auto' in experiment params `cfg`.

  A `PipelinedTask` holds it on the task (its child `pipeline`); any other
  experiment on its PipeliningLayers in the tree (`task.lm.stack`).
  """
  if pipeline_tree.IsPipelinedTask(cfg.task):
    holders = [('task', cfg.task, 'pipeline')]
  else:
    holders = [(f'task.{path}', p, path)
               for path, p in pipeline_tree.Pipelines(cfg.task)]
  return [(f'{path}.jit_compile', p, child) for path, p, child in holders
          if 'jit_compile' in p and
          jit_choice.Normalize(path, p.jit_compile) == 'auto']


def _Captured(cfg, children):
  """{path in the task: (layer params, input TensorSpecs)} of the task's
  pipelines at `children`, as its forward pass built them (TF)."""
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from lingvo_ext.pipeline import cost  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  py_utils.SetEagerMode(False)
  task_p = cfg.task.Copy()
  task_p.input = cfg.input.Copy()
  tree.EvalSettingsForProfiling(task_p)
  evaler = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=1, split_size=1, do_eval=True)
  got = {}
  with cost.Sandbox(), evaler:
    py_utils.GetOrCreateGlobalStepVar()
    task = task_p.Instantiate()
    layers = tree.CapturePipelineInputs(task, [(c, None) for c in children],
                                        got)
    task.FPropDefaultTheta()
    spec = lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype)
    return {c: (layers[c].params, tf.nest.map_structure(spec, got[c][1]))
            for c in children if c in got}


def _Pending(cfg, num_devices: int, do_eval: bool):
  """({override path: (bool, why)} known without timing, [(override path,
  layer params, input specs)] to time) of each 'auto' of `cfg` (TF)."""
  autos = Autos(cfg)
  captured = _Captured(cfg, [child for _, _, child in autos])
  out, todo = {}, []
  for path, _, child in autos:
    if child not in captured:
      out[path] = (False, "'auto' took False: the task's forward pass runs "
                   'no pipeline there to time')
      continue
    params, specs = captured[child]
    why = jit_choice.Unmeasurable(params, specs)
    entry = None if why else jit_choice.Cached(params, specs, do_eval,
                                               num_devices)
    if why:
      out[path] = (False, f"'auto' took False: {why}")
    elif entry is not None:
      out[path] = (bool(entry['jit_compile']),
                   "'auto' " + jit_choice.Describe(entry, 'cached in'))
    else:
      todo.append((path, params, specs))
  return out, todo


def _Measured(todo, num_devices: int, do_eval: bool, measure=None):
  """{override path: (bool, why)} of each of `todo` (_Pending's), cached or
  timed now in this process."""
  from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import jit_measure  # pylint: disable=g-import-not-at-top
  out = {}
  for path, params, specs in todo:
    entry, how = jit_measure.CachedOrMeasured(
        params, specs, do_eval, num_devices, gpipe.PipeliningLayer.FProp,
        measure)
    out[path] = (bool(entry['jit_compile']),
                 "'auto' " + jit_choice.Describe(entry, how))
  return out


def Choices(cfg, num_devices: int, do_eval: bool = False,
            measure=None) -> Dict[str, Tuple]:
  """{override path: (True or False, why)} of each 'auto' of `cfg`, for a
  training (or `do_eval`) build on `num_devices` devices per split: cached,
  else measured now in this process (TF). `measure`: jit_measure.Measure (a
  test's stand-in)."""
  if not Autos(cfg):
    return {}
  out, todo = _Pending(cfg, num_devices, do_eval)
  out.update(_Measured(todo, num_devices, do_eval, measure))
  return out


def _Job(payload: bytes, conn) -> None:
  """Sends ('ok', _Measured) of the pickled (todo, num_devices, do_eval,
  stable names), or ('error', type, first line) (in a fresh process)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils_flags  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import

  from lingvo_ext import xla_cache  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import plan_prediction  # pylint: disable=g-import-not-at-top
  plan_prediction.EndWithParent()
  try:
    if not flags.FLAGS.is_parsed():  # Lingvo's layers read some as they build.
      flags.FLAGS(['jit_compile_auto'])
    todo, num_devices, do_eval, stable_names = pickle.loads(payload)
    if stable_names:  # The trainer's cell names: XLA's cache serves both.
      xla_cache.UseStableNames()
    conn.send(('ok', _Measured(todo, num_devices, do_eval)))
  except Exception as e:  # pylint: disable=broad-except
    lines = str(e).strip().splitlines()
    conn.send(('error', type(e).__name__, lines[0] if lines else ''))
  conn.close()


def _InFreshProcess(payload: bytes, timeout_s: float):
  """_Job's Choices, run in a process forked from a server (which imported
  the planner), ended when done or after `timeout_s`."""
  import multiprocessing  # pylint: disable=g-import-not-at-top
  ctx = multiprocessing.get_context('forkserver')
  ctx.set_forkserver_preload(['lingvo_ext.planner'])
  receive, send = ctx.Pipe(duplex=False)
  proc = ctx.Process(target=_Job, args=(payload, send), daemon=True,
                     name='jit_compile_auto')
  proc.start()
  send.close()
  try:
    if not receive.poll(timeout_s):
      raise RuntimeError(f'it took over {timeout_s:.0f} s')
    try:
      got = receive.recv()
    except EOFError:
      proc.join(10)
      raise RuntimeError('its process ended with no answer (exit code '
                         f'{proc.exitcode})') from None
  finally:
    proc.kill()
    proc.join(10)
    receive.close()
  if got[0] != 'ok':
    raise RuntimeError('%s: %s' % got[1:])
  return got[1]


def Resolve(cfg, num_devices: int, fresh_process: bool = True,
            timeout_s: float = TIMEOUT_S,
            do_eval: bool = False) -> List[jit_default.Decision]:
  """Sets each 'auto' jit_compile of experiment params `cfg` (in place) to
  True or False, the faster training (or `do_eval`) build on `num_devices`
  devices per split (cached or timed); one Decision per pipeline, in the
  log's words.

  The inputs are read in this process; a timing the cache lacks runs in a
  fresh process (`fresh_process`, when the layers' params pickle); if it
  fails or takes over `timeout_s`, those pipelines build without XLA and
  the Decision says why.
  """
  from lingvo_ext import xla_cache  # pylint: disable=g-import-not-at-top
  autos = Autos(cfg)
  if not autos:
    return []
  choices = {}
  try:
    # The inputs are read here (a throw-away eval build); only a timing,
    # when the cache lacks one, runs in a fresh process.
    choices, todo = _Pending(cfg, num_devices, do_eval)
    payload = None
    if todo and fresh_process:
      try:
        payload = pickle.dumps((todo, num_devices, do_eval,
                                xla_cache.StableNames()))
      except (pickle.PicklingError, TypeError, AttributeError) as e:
        tf.logging.info("jit_compile 'auto': the params do not pickle (%s); "
                        'timed in this process.', e)
    if todo:
      choices.update(_InFreshProcess(payload, timeout_s) if payload else
                     _Measured(todo, num_devices, do_eval))
  except Exception as e:  # pylint: disable=broad-except
    # A timing that fails never stops the run: the build reports a bad model.
    text = str(e).strip().splitlines()
    why = "'auto' took False: the timing failed (%s)" % (
        text[0] if text else type(e).__name__)
    for path, _, _ in autos:
      choices.setdefault(path, (False, why))
  decisions = []
  for path, p, _ in autos:
    value, why = choices[path]
    p.jit_compile = value
    decisions.append(jit_default.Decision(value, (path,), why))
  return decisions


def ResolveLayer(params, run, num_devices: int) -> jit_default.Decision:
  """Sets the 'auto' jit_compile of PipeliningLayer `params` that a library
  user builds directly (in place) to True or False: cached, else timed in
  this process. `run(layer)` calls the layer's (or its subclass's) FProp on
  inputs shaped as the real ones; it runs in a throw-away graph, in eval on
  one device, where the capture hook reads the pipeline's inputs."""
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  from lingvo_ext.core import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_ext.pipeline import cost  # pylint: disable=g-import-not-at-top
  from lingvo_ext.runtime import jit_measure  # pylint: disable=g-import-not-at-top
  got = []
  evaler = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=1, split_size=1, do_eval=True)
  with cost.Sandbox(), evaler:
    py_utils.GetOrCreateGlobalStepVar()
    layer = params.Copy().Instantiate()
    layer.AddCaptureHook(lambda theta, args: got.append(args))
    run(layer)
    specs = tf.nest.map_structure(
        lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype),
        got[0])
  why = jit_choice.Unmeasurable(layer.params, specs)
  if why:
    value, why = False, f"'auto' took False: {why}"
  else:
    entry, how = jit_measure.CachedOrMeasured(
        layer.params, specs, False, num_devices, gpipe.PipeliningLayer.FProp)
    value = bool(entry['jit_compile'])
    why = "'auto' " + jit_choice.Describe(entry, how)
  params.jit_compile = value
  return jit_default.Decision(value, (f'{params.name}.jit_compile',), why)


# The jobs that build the training model (an evaler's or decoder's model is
# its dataset's, in eval).
_TRAINING_JOBS = ('controller', 'trainer_client', 'trainer')


def ForRun(o, cfg, steps_to_go: Optional[int]) -> List[str]:
  """The trainer's XLA step on its training params `cfg` (in place), before
  the model is built; its log lines.

  A local training run (`steps_to_go` given: max_steps less the step it
  resumes from) sets each unset jit_compile from --jit_compile
  (jit_default.Apply); a process that builds the training model then
  resolves each 'auto' (`Resolve`). `o`: trainer_flags.Options.
  """
  lines = []
  if steps_to_go is not None:
    decision = jit_default.Apply(cfg, o.jit_compile, steps_to_go,
                                 o.jit_auto_min_steps)
    lines += [decision.Line()] if decision else []
  if set(o.jobs) & set(_TRAINING_JOBS):
    lines += [d.Line() for d in Resolve(cfg, o.worker_split_size)]
  return lines


def ForEvalDataset(o, cfg) -> List[str]:
  """The XLA step of an evaler's or decoder's dataset params `cfg` (in
  place), before its model is built; its log lines. On one device eval
  runs the cells in turn (no cell function): nothing to resolve."""
  if o.worker_split_size < 2:
    return []
  return [d.Line() for d in Resolve(cfg, o.worker_split_size, do_eval=True)]
