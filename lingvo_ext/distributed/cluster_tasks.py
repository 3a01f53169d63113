"""The tasks of a local cluster: their addresses, commands and environment.

`ClusterTasks` lays out a launcher's cluster on free ports of 127.0.0.1 and
tells each task its place as --cluster_from says: flags (--cluster_spec,
--job, --task; a controller, a trainer client, the workers), tf_config (a
TF_CONFIG variable per task and --cluster_resolver=tf_config: a chief
running the controller and trainer client, the workers) or slurm (SLURM_*
variables as srun sets them for --nodes nodes, 127.0.0.1, 127.0.0.2, ...,
and --cluster_resolver=slurm); ps tasks then hold the variables.
"""

import dataclasses
import subprocess
import sys
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import network
from lingvo_ext.distributed import resolvers

CLUSTER_FROM = ('flags', 'tf_config', 'slurm')


def ClusterJobs(num_workers: int, host: str = '127.0.0.1',
                num_ps: int = 0) -> Dict[str, List[str]]:
  """{job: [host:port]} of a local cluster with free ports."""
  ports = network.FreePorts(num_workers + num_ps + 2, host)
  jobs = {
      'controller': [f'{host}:{ports[0]}'],
      'trainer_client': [f'{host}:{ports[1]}'],
      'worker': [f'{host}:{p}' for p in ports[2:2 + num_workers]],
  }
  if num_ps:
    jobs['ps'] = [f'{host}:{p}' for p in ports[2 + num_workers:]]
  return jobs


def TaskCommand(jobs: Dict[str, List[str]], job: str, task: int,
                trainer_flags: Sequence[str]) -> List[str]:
  """The trainer command line of one task of the cluster `jobs`."""
  # --logtostderr: the task's whole log goes to its LOGDIR/launch file (the
  # trainer's own log file is per job, and the workers share a job).
  return [
      sys.executable, '-m', 'lingvo_ext.trainer',
      f'--cluster_spec={cluster.FormatClusterSpec(jobs)}', '--mode=sync',
      f'--job={job}', f'--task={task}', '--logtostderr', *trainer_flags
  ]


@dataclasses.dataclass
class Task:
  """One process of the cluster."""
  job: str
  task: int
  address: str
  argv: List[str]
  env: Dict[str, str] = dataclasses.field(default_factory=dict)
  # subprocess.Popen, or fork_server.ForkedProcess.
  proc: Optional[subprocess.Popen] = None
  done: bool = False  # Exited 0 at the end of training.
  ready: bool = False
  started_at: float = 0.0
  log_path: str = ''
  log_pos: int = 0  # Bytes of the log already read.
  partial: bytes = b''
  last_answer: float = 0.0  # time.monotonic() of its last answer.
  hung: bool = False  # Killed by the launcher for not answering.
  restarts: int = 0  # Times the launcher restarted it.
  rss: Optional[int] = None  # Its last resident memory seen.
  cgroup: Optional[str] = None  # Its memory cgroup's directory.
  oom_kills: Optional[int] = None  # The cgroup's OOM kills at its start.
  errors: Any = None  # Its task_output.ErrorPipe.

  @property
  def name(self) -> str:
    return self.job if self.job != 'worker' else f'worker{self.task}'

  @property
  def what(self) -> str:
    return f'{self.job} task {self.task} ({self.address})'


def ClusterTasks(num_workers: int, trainer_flags: Sequence[str],
                 cluster_from: str = 'flags', num_ps: int = 0,
                 nodes: int = 1, host: str = '127.0.0.1') -> List[Task]:
  """The tasks of a local cluster, told their place as `cluster_from` says.

  Args:
    num_workers: Worker tasks.
    trainer_flags: The user's trainer flags, passed to every task.
    cluster_from: 'flags', 'tf_config' or 'slurm' (see the module doc).
    num_ps: ps tasks ('flags' and 'tf_config').
    nodes: 'slurm': the step's nodes; node n is 127.0.0.(n+1).
    host: 'flags' and 'tf_config': every task's host.

  Returns:
    Workers and ps first (the clients wait for them), then the clients.
  """
  tail = ['--mode=sync', '--logtostderr', *trainer_flags]
  trainer = [sys.executable, '-m', 'lingvo_ext.trainer']
  tasks = []
  if cluster_from == 'flags':
    jobs = ClusterJobs(num_workers, host, num_ps)
    for job in ('worker', 'ps', 'controller', 'trainer_client'):
      for t, address in enumerate(jobs.get(job, ())):
        tasks.append(Task(job, t, address, TaskCommand(jobs, job, t,
                                                       trainer_flags)))
    return tasks
  if cluster_from == 'tf_config':
    ports = network.FreePorts(1 + num_workers + num_ps, host)
    spec = {'chief': [f'{host}:{ports[0]}'],
            'worker': [f'{host}:{p}' for p in ports[1:1 + num_workers]]}
    if num_ps:
      spec['ps'] = [f'{host}:{p}' for p in ports[1 + num_workers:]]
    argv = trainer + ['--cluster_resolver=tf_config', *tail]
    for job in ('worker', 'ps', 'chief'):
      for t, address in enumerate(spec.get(job, ())):
        tasks.append(Task(job, t, address, argv,
                          {'TF_CONFIG': resolvers.TFConfig(spec, job, t)}))
    return tasks
  if cluster_from == 'slurm':
    hosts = [f'127.0.0.{n + 1}' for n in range(nodes)]
    # The chief (rank 0) on the first node, then the workers in order.
    per_node = [num_workers // nodes] * nodes
    per_node[0] += 1
    base = network.FreePortRange(1 + num_workers)
    argv = trainer + ['--cluster_resolver=slurm',
                      f'--slurm_port_base={base}', *tail]
    for rank in range(1 + num_workers):
      env = resolvers.SlurmEnv(hosts, per_node, rank)
      # What resolvers.FromSlurm makes of it (without importing TensorFlow
      # here): rank 0 the chief, rank 1+i worker i, port base + rank.
      address = f'{env["SLURMD_NODENAME"]}:{base + rank}'
      tasks.append(Task('chief' if rank == 0 else 'worker', max(rank - 1, 0),
                        address, argv, env))
    return tasks[1:] + tasks[:1]
  raise ValueError(f'--cluster_from={cluster_from} is not one of '
                   f'{", ".join(CLUSTER_FROM)}.')
