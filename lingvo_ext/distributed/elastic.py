"""Elastic pipelines: when the launcher's cluster has lost a worker for good,
and what it does then (pure Python: no TensorFlow, no processes).

A worker task is lost for good when it fails once the cluster has used its
--max_restarts, or when a restarted task does not serve its port within the
bound (--ready_timeout_secs). With --elastic (the default) the launcher then
re-plans the pipeline onto the devices left (tools/replan.py, the planner
with its memory check, the experiment's global batch kept), restarts a
smaller cluster with the new plan's flags, and resumes from the newest
checkpoint (its names do not depend on the cut: docs/faults.md). Where no
plan fits, or the lost task is not a worker, the cluster stops as without
--elastic. See `LostForGood`, `NotBack`, `Decide`, `NewLayout`,
`ReplannedFlags`.
"""

import dataclasses
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

REPLAN = 'replan'
STOP = 'stop'


@dataclasses.dataclass(frozen=True)
class Loss:
  """A task lost for good: which one and why (for the launcher's line)."""
  job: str
  task: int
  why: str

  @property
  def what(self) -> str:
    return f'{self.job} task {self.task}'


@dataclasses.dataclass(frozen=True)
class Decision:
  """What to do about a Loss: REPLAN onto `devices_left`, or STOP."""
  action: str
  workers_left: int = 0
  devices_left: int = 0
  # Data-parallel replicas before the loss: the global batch is their
  # per-replica batch times this.
  replicas: int = 0
  why: str = ''  # For STOP: the reason, one line.


def LostForGood(job: str, task: int, how: str, restarts: int,
                max_restarts: int) -> Optional[Loss]:
  """The Loss of a task that died (`how`: 'signal SIGKILL') once the cluster
  had used its restarts; None while it may still be restarted."""
  if restarts < max_restarts:
    return None
  return Loss(job, task, f'{how} after {restarts} restart(s) in all, '
              f'--max_restarts={max_restarts}')


def NotBack(job: str, task: int, restarted: bool, ready: bool,
            waited_s: float, ready_timeout_s: float) -> Optional[Loss]:
  """The Loss of a restarted task that has not served its port for
  `waited_s` > `ready_timeout_s` since its restart; else None."""
  if not restarted or ready or waited_s <= ready_timeout_s:
    return None
  return Loss(job, task, f'not back {waited_s:.0f} s after its restart, '
              f'--ready_timeout_secs={ready_timeout_s:g}')


def Replicas(num_workers: int, devices_per_worker: int,
             split_size: int) -> int:
  """Data-parallel replicas of a cluster's layout (cluster.MakeWorkerLayout)."""
  return max(1, num_workers * devices_per_worker // max(1, split_size))


def Decide(loss: Loss, num_workers: int, devices_per_worker: int,
           split_size: int, elastic: bool) -> Decision:
  """REPLAN onto the workers left, or STOP (not elastic, not a worker, or
  no worker left)."""
  if not elastic:
    return Decision(STOP, why='--elastic=false')
  if loss.job != 'worker':
    return Decision(STOP, why=f'the lost task is the {loss.job}, not a '
                    'worker: only workers are re-planned around')
  left = num_workers - 1
  if left < 1:
    return Decision(STOP, why='no worker is left to re-plan onto')
  return Decision(REPLAN, workers_left=left,
                  devices_left=left * devices_per_worker,
                  replicas=Replicas(num_workers, devices_per_worker,
                                    split_size))


def NewLayout(plan_devices: int, devices_per_replica: int,
              devices_per_worker: int,
              nodes: int = 1) -> Tuple[Optional[Tuple[int, int]], str]:
  """((workers, worker_split_size), '') for a plan on `plan_devices` devices,
  `devices_per_worker` each (--num_cpu_devices); (None, why) where the plan's
  devices do not make whole workers (or, under Slurm, whole nodes)."""
  if plan_devices % devices_per_worker:
    return None, (f'the plan needs {plan_devices} devices, not a multiple of '
                  f'--num_cpu_devices={devices_per_worker}')
  workers = plan_devices // devices_per_worker
  if workers % nodes:
    return None, (f'the plan needs {workers} workers, not a multiple of '
                  f'--nodes={nodes}')
  return (workers, devices_per_replica), ''


def ReplannedFlags(trainer_flags: Sequence[str], override: str,
                   num_cpu_devices: int, split_size: int) -> List[str]:
  """The trainer flags with the new plan's --model_params_override (the
  user's, then the plan's), --num_cpu_devices and --worker_split_size."""
  replaced = ('model_params_override', 'num_cpu_devices', 'worker_split_size',
              'plan')
  out = [f for f in trainer_flags
         if f[2:].split('=', 1)[0] not in replaced]
  return out + [f'--model_params_override={override}',
                f'--num_cpu_devices={num_cpu_devices}',
                f'--worker_split_size={split_size}']


def Plural(n: int, word: str) -> str:
  return f'{n} {word}' + ('' if n == 1 else 's')


def LossLine(loss: Loss, workers: int, cells: int, devices: int,
             micro_batches: int, checkpoint: Optional[str]) -> str:
  """The launcher's one line for a re-planned cluster."""
  start = (f'resuming from {checkpoint}' if checkpoint else
           'no checkpoint yet: starting from the initial weights')
  return (f'launch: {loss.what} is lost for good ({loss.why}): re-planned '
          f'onto {Plural(workers, "worker")} ({Plural(cells, "cell")} on '
          f'{Plural(devices, "device")}, M {micro_batches}); {start}.')


def RecoveredLine(step: int, seconds: float, workers: int) -> str:
  """The launcher's line at the first step trained after a re-plan."""
  return (f'launch: recovered: step {step} trained {seconds:.1f} s after the '
          f'loss, on {Plural(workers, "worker")}.')


def StepOf(line: str) -> Optional[int]:
  """The step of a trainer's progress line ('step 12/100  loss ...')."""
  if not line.startswith('step '):
    return None
  head = line[5:].split('/', 1)[0]
  return int(head) if head.isdigit() else None
