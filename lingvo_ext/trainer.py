r"""Trains or evaluates a registered lingvo_ext experiment with Lingvo's runners.

  .venv/bin/python -m lingvo_ext.trainer --model=lm.TransformerLm --logdir=/tmp/lm
  .venv/bin/tensorboard --logdir=/tmp/lm

This is `lingvo.trainer` (its RunnerManager, Controller, Trainer and Evaler,
and all of its flags) with lingvo_ext's experiments registered and these
changes:

- Defaults: --run_locally=cpu --mode=sync, so the jobs are
  controller,trainer_client in this process; checkpoints go to DIR/train,
  the trainer's summaries (loss, log_pplx, global_step/sec...) to DIR/train, the
  controller's to DIR/control.
- --num_cpu_devices=N gives each local replica N logical CPU devices (the
  local server, the sessions and the cluster's job specs all get N), so
  --worker_split_size=N pipelines a model's cells across them. Stock
  lingvo.trainer always has one CPU device. The devices share one intra-op
  pool of cores / N threads (--intra_op_threads), so N ops at once do not
  oversubscribe the cores.
- --max_steps overrides the experiment's train.max_steps. Training resumes
  from the last checkpoint in DIR/train.
- Variables are initialized with stateless RNGs seeded by their names
  (--stateless_vars_init defaults to True), so runs are reproducible and do
  not depend on how a model is partitioned.
- --job=evaler_dev evaluates DIR/train's checkpoints on the dev split
  (summaries in DIR/eval_dev); add it to the training jobs
  (--job=controller,trainer_client,evaler_dev) to evaluate as training goes.
  Evalers and decoders print each result (`evaler_dev: step 30  log_pplx
  3.26 ...`) and stop after the checkpoint of the trainer's last step:
  the --max_steps it records in DIR/train/training_max_steps, or its
  training_finished (runtime/training_end.py).
- One trainer per logdir (a lock on DIR/trainer.lock for the process's
  life); a finished logdir says `already trained to step N (max_steps N):
  nothing to do` and exits with 0.
- An unknown --model prints the close registered names and exits with 2;
  --model=module.Class also finds an experiment module on PYTHONPATH (see
  lingvo_ext/registry.py).
- Failing safely: bad flags, an unusable --logdir, bad params and bad
  --model_params_override keys or values are one line and exit 2, before
  anything is written to the logdir (tasks/experiment_params.py checks the
  overrides). After --max_nonfinite_steps steps in a row whose loss or
  gradients are NaN/Inf, training stops (exit 3) naming the step, the first
  non-finite tensor and the last good checkpoint; no checkpoint holding
  NaN/Inf is written. A damaged latest checkpoint is skipped for the newest
  intact one, and a damaged `checkpoint` state file is rebuilt from the
  checkpoints on disk (lingvo_ext/checkpoints/). A resume on training
  input files that changed since the logdir's first start is one warning
  line (--accept_changed_input silences it), on a changed vocab a refusal
  (runtime/input_guard.py); input files that break mid-run save the step,
  then exit 65. SIGTERM or SIGHUP (a
  cluster stopping the job) saves the current step and exits 0, Ctrl-C the
  same with 130; a second signal, or --shutdown_grace_secs, exits at once
  (143) with the last complete checkpoint as the latest
  (lingvo_ext/runtime/shutdown.py, docs/preemption.md).
- --eval_once (or --eval_checkpoint=PATH): evalers and decoders evaluate
  the newest (or that) checkpoint, print the metrics line and exit 0;
  with --eval_one_pass, over every example of the Dev/Test files once
  (docs/machine-translation.md).
- A model with partitioned variables (a layer's `partitioner` set, e.g.
  lm.WordLmSharded) saves checkpoints with tf.train.Saver
  (--use_custom_saver=false unless given), whose saved slices restore into
  any other partitioning: lm.WordLm resumes from lm.WordLmSharded's logdir
  and back.
"""

import dataclasses
import functools
import gc
import os
import sys
import threading
import time
import traceback

# Run as the program (python -m, or pyproject.toml's script): what the
# imports below make lives as long as the process, so the collector is off
# while they run and then skips it (docs/benchmarks.md, "gc.freeze").
_PROGRAM = (__name__ == '__main__' or os.path.basename(
    sys.argv[0] if sys.argv else '') == 'lingvo-ext-train')
if _PROGRAM:
  gc.disable()

from lingvo_ext import entry_point  # pylint: disable=g-bad-import-order,g-import-not-at-top,wrong-import-position

# isort: split
from absl import app
import lingvo.compat as tf
from lingvo.core import hyperparams
from lingvo.core import py_utils

from lingvo_ext import _startup
from lingvo_ext import devices
from lingvo_ext._internal import lingvo as internal_lingvo
from lingvo_ext._internal import process
from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import server
from lingvo_ext.distributed import task_output
from lingvo_ext.preflight import memory_check
from lingvo_ext.preflight import param_checks
from lingvo_ext.runtime import cluster_plan_check
from lingvo_ext.runtime import flag_checks
from lingvo_ext.runtime import input_guard
from lingvo_ext.runtime import jit_resolve
from lingvo_ext.runtime import logdir as logdir_lib
from lingvo_ext.runtime import plan_prediction
from lingvo_ext.runtime import progress
from lingvo_ext.runtime import runners
from lingvo_ext.runtime import shutdown
from lingvo_ext.runtime import trainer_flags
from lingvo_ext.runtime import trainer_lib
from lingvo_ext.runtime import training_end
from lingvo_ext.tasks import run_params as run_params_lib

if _PROGRAM:
  gc.freeze()
  gc.enable()

FLAGS = tf.flags.FLAGS


# The lock a training process holds on its logdir (runtime/logdir.py).
LOCK_FILE = logdir_lib.LOCK_FILE


def _TrainParams(o):
  """(error or None, the experiment's training params): the run's one build."""
  try:
    return None, run_params_lib.RunParams(o).Train()
  except (ValueError, AttributeError, LookupError) as e:
    return runners.FirstLine(e), None


def _AutoPlan(o, cfg):
  """--plan=auto on the built `cfg`: (error or None, options, planned params).

  The plan is set on a copy of `cfg`, typed; the options (and FLAGS) get
  its flags and its --model_params_override text, the reproducible record.
  """
  if o.plan != 'auto':
    return (f"--plan={o.plan}: the only plan is 'auto'; pass --plan=auto or "
            'leave it out.'), o, cfg
  from lingvo_ext.planner import auto as plan_tool  # pylint: disable=g-import-not-at-top
  num_devices = o.devices or o.num_cpu_devices
  plan = lambda budget: plan_tool.PlanParams(  # pylint: disable=g-long-lambda
      cfg, o.model, num_devices, budget, o.model_params_override,
      o.gpipe_engine)
  try:
    chosen = plan(o.memory_per_device or None)
  except (ValueError, LookupError) as e:
    return runners.FirstLine(e), o, cfg
  print(chosen.line, flush=True)
  # The re-plan within the memory there is starts from the same unplanned
  # params: nothing is built again.
  warning = memory_check.CheckAutoPlan(
      chosen.plan, num_devices,
      lambda budget: (lambda p: (p.override, p.flags))(plan(f'{budget}B')))
  if warning:
    print(warning, file=sys.stderr, flush=True)
  flags = dict(chosen.flags, model_params_override=chosen.override)
  for k, v in flags.items():  # Lingvo's RunnerManager reads them from FLAGS.
    FLAGS[k].value = v
  return None, dataclasses.replace(o, **flags), chosen.params


def _SetThreadPools(o):
  """TensorFlow's intra-op pool for this process (--intra_op_threads).

  Set before anything builds a graph or a server (--plan=auto's probe does):
  the first tf.function (lingvo_ext's cell functions, Lingvo's loop) or
  server makes the process-wide pool that every later session shares,
  whatever its config says.
  """
  n = o.IntraOpThreads()
  if n:
    tf.config.threading.set_intra_op_parallelism_threads(n)


def _HasPartitioner(p):
  """Whether params p, or any nested in it, set a `partitioner`."""
  if isinstance(p, (list, tuple)):
    return any(_HasPartitioner(x) for x in p)
  if not isinstance(p, hyperparams.Params):
    return False
  for name, value in p.IterParams():
    if name == 'partitioner' and value is not None:
      return True
    if _HasPartitioner(value):
      return True
  return False


def _UseSlicedCheckpoints(cfg):
  """TF's Saver for models with partitioned variables.

  Lingvo's own saver writes each shard under its own name; tf.train.Saver
  writes a partitioned variable as one tensor in saved slices, which restores
  into any other partitioning. An explicit --use_custom_saver wins.
  """
  if FLAGS['use_custom_saver'].present:
    return
  if _HasPartitioner(cfg):
    FLAGS.use_custom_saver = False  # Lingvo's Checkpointer reads it.


def _StopOnSignals(o, run_state):
  """SIGTERM, SIGHUP and Ctrl-C: stop safely (runtime/shutdown.py)."""
  train_dir = os.path.join(o.logdir, 'train') if o.logdir else ''
  owns = o.trains_here

  def Latest():
    return (tf.train.latest_checkpoint(train_dir) if train_dir else None) or (
        'none')

  def NothingToSave():
    if not owns or run_state.first_save_done.is_set() or (
        train_dir and tf.train.latest_checkpoint(train_dir)):
      return None
    return 'no checkpoint yet (training had not started): nothing to save'

  on_stop = None
  if o.distributed and o.jobs[0] in server.SERVER_JOBS:
    on_stop = lambda: threading.Thread(
        target=_ServeUntilClientsExit,
        args=(o.cluster_spec, o.preempted_exit_code), daemon=True).start()
  return shutdown.StopOnSignals(run_state, o.shutdown_grace_secs,
                                NothingToSave, Latest, owns, on_stop,
                                preempted_code=o.preempted_exit_code)


def _ServeUntilClientsExit(cluster_spec, code):
  """A worker or ps after a stop signal: serves until the clients exit.

  The controller's last save reads the variables this task holds; then the
  task exits with `code` (--preempted_exit_code).
  """
  jobs = cluster.ParseClusterSpec(cluster_spec)
  clients = [a for j in ('controller', 'trainer_client')
             for a in jobs.get(j, ())]
  while any(cluster.Answers(a) for a in clients):
    time.sleep(0.2)
  print('the clients have exited: exiting.', file=sys.stderr, flush=True)
  process.ExitNow(code)


def main(unused_argv, options=None, run_state=None, params=None):
  """Runs Lingvo's runners (Run has checked and read the flags).

  `params`: the run's RunParams (Run's one build), or None to build them.
  """
  o = options or trainer_flags.Options.FromFlags()
  params = params or run_params_lib.RunParams(
      o, eval_build=functools.partial(jit_resolve.ForEvalDataset, o))
  internal_lingvo.InitTpuEmbeddingManager()  # As lingvo.trainer.main.
  if run_state is None:
    run_state = runners.RunState()
    _StopOnSignals(o, run_state).Install()
  if o.run_locally == 'cpu' and o.num_cpu_devices > 1:
    splits = devices.Replicas(o.num_cpu_devices, o.worker_split_size)
    if splits > 1:
      print(f'note: --num_cpu_devices={o.num_cpu_devices} with '
            f'--worker_split_size={o.worker_split_size} runs {splits} '
            'data-parallel splits, each on a full input batch_size; pass '
            f'--worker_split_size={o.num_cpu_devices} to pipeline the '
            f'model over the {o.num_cpu_devices} devices instead.',
            flush=True)
  if o.logdir and not FLAGS.logtostderr:
    job = ','.join(o.jobs) if not o.job else o.job
    log_file = progress.LogFilePath(o.logdir, job,
                                    o.task if o.distributed else None)
    print(f'lingvo_ext.trainer: --model={o.model} --job={job}; '
          f'the full log is in {log_file} (--alsologtostderr to print it '
          'here too).', flush=True)
    progress.RouteLogToFile(log_file)
    if o.distributed:
      threading.excepthook = progress.SessionCloseErrorsToLogFile(
          threading.excepthook)
    # absl's log handler reads it: errors still reach stderr, unless the
    # user gave a threshold.
    FLAGS.stderrthreshold = o.stderrthreshold or 'error'
  if o.start_warning:  # Printed by the check, before the log was the file.
    tf.logging.warning('%s', o.start_warning)
  input_fault = input_guard.Watch(o, params.Train(), run_state)
  if o.trains_here and o.logdir:  # Evalers and decoders follow it.
    training_end.Record(os.path.join(o.logdir, 'train'), (
        params.Train().train.max_steps if o.max_steps is None else
        o.max_steps))
  steps_to_go = None  # A local training run's (its choices read them).
  if o.trains_here and not o.distributed:
    step, max_steps = logdir_lib.ResumeStep(o, params.Train())
    steps_to_go = max(max_steps - (step or 0), 0)
  # XLA's choice, before any runner builds the model.
  for line in jit_resolve.ForRun(o, params.Train(), steps_to_go):
    tf.logging.info('%s', line)
  if steps_to_go is not None:
    run_state.plan_check = plan_prediction.Start(
        o, steps_to_go, stop=run_state.interrupted)
  elif o.distributed and 'trainer_client' in o.jobs:
    # A cluster's: the step here, the memory the workers' (cells).
    run_state.plan_check = cluster_plan_check.ClientCheck(
        o, params.Train().train.max_steps if o.max_steps is None else
        o.max_steps, stop=run_state.interrupted)
  elif o.distributed and o.jobs[0] == 'worker':
    cluster_plan_check.StartWorker(o, run_state.interrupted)
  threads = o.IntraOpThreads()
  if threads:
    tf.logging.info('intra-op threads: %d (--intra_op_threads)', threads)
  # TensorFlow's and Lingvo's imported objects live as long as the process:
  # frozen, the collections that building the graphs sets off, and the one
  # at exit, no longer walk them (docs/benchmarks.md, "gc.freeze").
  gc.freeze()
  try:
    runners.RunnerManager(o.model, o, run_state, params).Start()
  except ValueError as e:  # Bad params, found while building the model.
    tf.logging.vlog(1, '%s', traceback.format_exc())
    print(f'error: {e}', file=sys.stderr, flush=True)
    return 2
  if input_fault and run_state.input_problem:
    input_fault.Exit()  # Exits 65.
  if run_state.interrupted.is_set():
    saved = run_state.final_save.is_set() or not o.trains_here
    code = shutdown.ExitCode(run_state.stop_signal, saved,
                             o.preempted_exit_code)
    if o.trains_here:
      last = tf.train.latest_checkpoint(os.path.join(o.logdir, 'train'))
      print(f'interrupted: the last checkpoint is {last}; run the same '
            'command to resume from it.', file=sys.stderr, flush=True)
    return code
  return 0


def _WriteInferenceGraph(o):
  """--mode=write_inference_graph, as the sequential model (docs/serving.md)."""
  from lingvo_ext.serving import export  # pylint: disable=g-import-not-at-top
  if not o.logdir:
    print('error: --logdir is required with --mode=write_inference_graph, '
          'e.g. --logdir=/tmp/lingvo_ext/lm', file=sys.stderr)
    return 2
  try:
    lines = export.WriteInferenceGraph(o.model, o.logdir,
                                       o.model_params_override, o.gpipe_engine)
  except (ValueError, LookupError, AttributeError) as e:
    print(f'error: --model={o.model}: {runners.FirstLine(e)}', file=sys.stderr)
    return 2
  print('\n'.join(lines), flush=True)
  return 0


# The flags --help describes; --helpfull lists all of Lingvo's and TF's.
_HELP_FLAGS = ('model', 'logdir', 'max_steps', 'num_cpu_devices',
               'worker_split_size', 'intra_op_threads', 'job',
               'model_params_override', 'plan', 'devices', 'memory_per_device',
               'jit_compile', 'max_nonfinite_steps', 'shutdown_grace_secs',
               'plan_check_steps', 'eval_once', 'eval_checkpoint',
               'eval_one_pass', 'accept_changed_input')


def _Help(full):
  if full:
    return FLAGS.get_help()
  lines = [__doc__.strip(), '', 'Flags (--helpfull lists all of them):']
  for name in _HELP_FLAGS:
    flag = FLAGS[name]
    lines.append(f'  --{name}: {flag.help} (default: {flag.default!r})')
  return '\n'.join(lines)


def Run(argv=None):
  """Parses flags, checks them, then runs Lingvo's trainer main."""
  argv = list(sys.argv if argv is None else argv)
  task_output.RelayErrorLines()  # A launcher's task: also over its pipe.
  # The trainer's defaults for Lingvo's flags: set here, at the entry point,
  # never at import.
  trainer_flags.SetTrainerDefaults()
  for arg in argv[1:]:
    if arg in ('-h', '--help', '-?', '--helpshort', '--helpfull'):
      print(_Help(full=arg == '--helpfull'))
      return 0
  error = entry_point.ParseFlags(argv[1:], program=argv[0])
  if error:
    message = ' '.join(error.split())
    print(f'error: {message} (--help lists the flags)', file=sys.stderr)
    return 2
  resolved, error = trainer_lib.ResolveCluster(  # --cluster_resolver
      FLAGS.cluster_resolver, FLAGS.mode, FLAGS.slurm_port_base,
      [f'--{n}' for n in ('cluster_spec', 'job', 'task') if FLAGS[n].present])
  if error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  if resolved:  # Lingvo's RunnerManager reads them from FLAGS.
    FLAGS.cluster_spec = resolved.cluster_spec
    FLAGS.job = resolved.job
    FLAGS.task = resolved.task
  if FLAGS.cluster_spec:  # One task of a cluster (lingvo_ext.distributed).
    FLAGS.set_default('run_locally', '')
  o = trainer_flags.Options.FromFlags()  # The flags, read once.
  shutdown.SetTitle(shutdown.TaskTitle(o.jobs, o.task, o.logdir,
                                       o.distributed))
  run_state = runners.RunState()
  _StopOnSignals(o, run_state).Install()
  # Everything checked before anything is written to the logdir.
  error = flag_checks.Check(o, FLAGS.worker_replicas if
                            FLAGS['worker_replicas'].present else None)
  if not error:
    _SetThreadPools(o)
  if not error:  # The params: built once, here, and handed down.
    error, cfg = _TrainParams(o)
  if not error and o.plan:
    error, o, cfg = _AutoPlan(o, cfg)
  if not error:
    params = run_params_lib.RunParams(
        o, train=cfg,
        eval_build=functools.partial(jit_resolve.ForEvalDataset, o))
    error, o = param_checks.Check(o, params)
  if not error:
    _UseSlicedCheckpoints(cfg)
  if not error and o.logdir:
    error = logdir_lib.Check(o.logdir)
  local = o.logdir and '://' not in o.logdir
  if not error and local and o.trains_here:
    error = logdir_lib.Lock(o.logdir)
  if not error and local and o.trains_here and o.mode != (
      'write_inference_graph'):
    error = input_guard.CheckFingerprint(o, cfg)
  if error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  if o.mode == 'write_inference_graph':
    return _WriteInferenceGraph(o)
  if local and o.trains_here and not o.distributed:
    done = logdir_lib.AlreadyTrained(o, cfg)
    if done:
      print(done, flush=True)
      return 0
  if FLAGS.disable_tf2:
    tf.disable_v2_behavior()
  py_utils.SetEagerMode(FLAGS.use_eager)
  _startup.FilterHarmlessLines()  # Checks passed: the run's console.
  # The flags were parsed once, above: absl's app.run keeps them as they are.
  app.run(lambda unused_argv: main(unused_argv, o, run_state, params),
          argv=argv,
          flags_parser=lambda args: args)
  return 0


if __name__ == '__main__':
  sys.exit(Run())
