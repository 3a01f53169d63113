"""The trainer's runners: Lingvo's, through Lingvo's extension points.

`RunnerManager` is Lingvo's, with the trainer's registry (its
`model_registry`), N logical CPU devices per local replica and the
multi-process mode (runtime/trainer_lib.py). It owns the `RunState` its
runners share (runner_state.py) and hands them, with the trainer's
`Options`, to the runner classes it names (its Controller/Trainer/Evaler/
Decoder attributes): `LocalController` (local_controller.py), `LocalTrainer`
(local_trainer.py), `LocalEvaler` and `LocalDecoder` (local_evaler.py).
"""

import functools
import os
import sys
import threading

from lingvo import trainer as lingvo_trainer
import lingvo.compat as tf

from lingvo_ext import checkpoints
from lingvo_ext._internal import tf as internal_tf
from lingvo_ext.distributed import server
from lingvo_ext.runtime import jit_resolve
from lingvo_ext.runtime import local_controller
from lingvo_ext.runtime import local_evaler
from lingvo_ext.runtime import local_trainer
from lingvo_ext.runtime import one_build
from lingvo_ext.runtime import runner_state
from lingvo_ext.runtime import trainer_flags
from lingvo_ext.runtime import trainer_lib
from lingvo_ext.tasks import one_pass
from lingvo_ext.tasks import run_params

# The names the trainer, tests and docs use from here.
RunState = runner_state.RunState
RunnerMixin = runner_state.RunnerMixin
FirstLine = runner_state.FirstLine
TRAINER_LOCK = runner_state.TRAINER_LOCK
LocalController = local_controller.LocalController
LocalTrainer = local_trainer.LocalTrainer
LocalEvaler = local_evaler.LocalEvaler
LocalDecoder = local_evaler.LocalDecoder

# Jobs whose devices are listed from the session (cluster.ListDevices); each
# must expect as many CPUs as the session has.
_JOB_SPECS = ('controller', 'train_summaries', 'worker', 'ps', 'evaler',
              'decoder')


class RunnerManager(trainer_lib.DistributedRunnerManagerMixin,
                    lingvo_trainer.RunnerManager):
  """Lingvo's RunnerManager, with N logical CPU devices per replica.

  Args:
    model: The registered experiment's name.
    options: trainer_flags.Options; read from the flags when None.
    run_state: The RunState its runners share; a new one when None.
    params: The run's RunParams (the trainer's one build); new when None.
  """

  def __init__(self, model, options=None, run_state=None, params=None):
    super().__init__(model)
    self._options = options or trainer_flags.Options.FromFlags()
    self.run_state = run_state or RunState()
    self._share_model = False
    self._trainer_here = None
    # Lingvo's extension point for the registry: every runner's params are
    # copies of the run's one build (run_params.py).
    self.run_params = params or run_params.RunParams(
        self._options, eval_build=functools.partial(
            jit_resolve.ForEvalDataset, self._options))
    self.model_registry = run_params.ModelRegistry(self.run_params)

  def _Runner(self, cls):
    return functools.partial(cls, run_state=self.run_state,
                             options=self._options)

  def _SharesModel(self, jobs):
    """Whether this process's controller shares its trainer's model."""
    return (not self._options.distributed and 'controller' in jobs and
            len(set(jobs)) == len(jobs) and
            bool({'trainer', 'trainer_client'} & set(jobs)))

  def CreateRunners(self, jobs, *args, **kwargs):
    """Lingvo's CreateRunners; a trainer here is built before the controller.

    The controller then takes the trainer's graph and model (one_build.py).
    """
    self._share_model = self._SharesModel(jobs)
    if not self._share_model:
      return super().CreateRunners(jobs, *args, **kwargs)
    order = sorted(jobs, key=lambda j: j not in ('trainer', 'trainer_client'))
    made = super().CreateRunners(order, *args, **kwargs)
    return [made[order.index(j)] for j in jobs]

  # pylint: disable=invalid-name
  @property
  def Controller(self):
    trainer = self._trainer_here
    if not (self._share_model and trainer and one_build.CanShare(
        trainer.model)):
      trainer = None
    return functools.partial(self._Runner(LocalController), trainer=trainer)

  @property
  def Trainer(self):
    def Make(*args, **kwargs):
      self._trainer_here = self._Runner(LocalTrainer)(*args, **kwargs)
      trainer = self._trainer_here
      if self._share_model and one_build.CanShare(trainer.model):
        trainer.PrepareAhead()  # Before the controller's build.
      return trainer
    return Make

  @property
  def Evaler(self):
    return self._Runner(LocalEvaler)

  @property
  def Decoder(self):
    return self._Runner(LocalDecoder)

  # pylint: enable=invalid-name

  def MaybeConfigRunLocally(self):
    """Lingvo's local set-up, with a local server of N CPU devices."""
    if not self._options.run_locally:
      return
    config = server.SessionConfig(self._options, client=False)
    with internal_tf.LocalServerConfig(config):
      super().MaybeConfigRunLocally()

  def UpdateClusterParamsFromFlags(self, cluster, job_name):
    super().UpdateClusterParamsFromFlags(cluster, job_name)
    o = self._options
    if o.run_locally:
      for name in _JOB_SPECS:
        cluster.Get(name).cpus_per_replica = o.num_cpu_devices
      # Evaluate and decode with the trainer's splits: otherwise, with
      # --worker_split_size=N, they would run N one-device splits, each on
      # a full batch (N times the training batch).
      # The controller builds the training graph too: with the trainer's
      # splits it sees the trainer's replicas (not one per CPU device).
      for name in ('evaler', 'decoder', 'controller'):
        cluster.Get(name).devices_per_split = o.worker_split_size

  def StartRunners(self, all_runners):
    """Lingvo's StartRunners, after skipping damaged checkpoints.

    Returns once the runners finish, or, after a stop signal, once the
    controller has saved and the others stopped (an evaler or decoder after
    the checkpoint it is on).
    """
    o = self._options
    if o.logdir and ('controller' in o.jobs or 'trainer_client' in o.jobs):
      RepairCheckpoints(os.path.join(o.logdir, 'train'))
    runner = threading.Thread(
        target=super().StartRunners, args=(all_runners,), daemon=True)
    runner.start()
    waited = [r for r in all_runners if isinstance(r, RunnerMixin)]
    while runner.is_alive():
      runner.join(0.5)
      # Each calls _DequeueThreadComplete when it stops (the controller
      # after its last checkpoint, an evaler after its checkpoint).
      if self.run_state.interrupted.is_set() and all(
          r.stopped for r in waited):
        break

  def GetParamsForDataset(self, job_name, dataset_name):
    cfg = super().GetParamsForDataset(job_name, dataset_name)
    if (self._share_model and job_name in ('trainer', 'trainer_client') and
        cfg.cluster.add_summary is None):
      # Lingvo's default adds summaries for the controller's build only; the
      # controller sharing this one fetches them with a step (one_build.py).
      cfg.cluster.add_summary = True
    if self._options.eval_one_pass and job_name.startswith(
        ('evaler', 'decoder')):
      one_pass.OnePass(cfg)
    if self._options.max_steps is not None:
      cfg.train.max_steps = self._options.max_steps
      if 'task' in cfg:  # A single-task model keeps a copy in its task.
        cfg.task.train.max_steps = self._options.max_steps
    return cfg


# Train dirs already repaired by this process: the repair runs before the
# runners (trainer.Run) and again where a RunnerManager is started directly.
_REPAIRED = {}


def RepairCheckpoints(train_dir):
  """Rebuilds a damaged state file, then skips damaged checkpoints.

  Returns:
    The checkpoint training resumes from, or None.
  """
  if train_dir in _REPAIRED:
    return _REPAIRED[train_dir]
  moved = checkpoints.LocalizeStateFile(train_dir)
  if moved:
    print(f'note: {moved}', file=sys.stderr, flush=True)
  problem = checkpoints.RebuildStateFile(train_dir)
  if problem:
    latest = tf.train.latest_checkpoint(train_dir)
    print(f'warning: {problem}; rebuilt it from the checkpoints on disk '
          f'(latest: {latest}).', file=sys.stderr, flush=True)
  path = checkpoints.NewestIntactCheckpoint(
      train_dir, none='nothing: starting afresh', repair=True)
  _REPAIRED[train_dir] = path
  return path
