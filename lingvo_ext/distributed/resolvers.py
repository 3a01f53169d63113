"""This process's cluster, job and task from TF_CONFIG or Slurm's environment.

`lingvo_ext.trainer --cluster_resolver=tf_config|slurm` reads them with
TensorFlow's own resolvers (`tf.distribute.cluster_resolver.
TFConfigClusterResolver`, `SlurmClusterResolver`) and maps them onto Lingvo's
jobs, so every process gets the same flags and only its environment differs:

  TF_CONFIG / Slurm task     Lingvo
  chief (one)                --job=controller,trainer_client: one process
                             runs the controller and the trainer client
  worker i                   --job=worker --task=i (cell c of replica r on
                             worker r*K+c, K = --worker_split_size)
  ps i                       --job=ps --task=i (holds the variables)

The chief's server is the cluster spec's `controller` job; the trainer
client runs in the same process on the same server, so the spec has no
`trainer_client` job.

Slurm: one `srun` step of N = R*K + 1 tasks (R replicas of a K-cell
pipeline): rank 0 (SLURM_PROCID) is the chief, rank 1+i is worker i.
SlurmClusterResolver places the ranks on the step's nodes in order
(SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE), so the tasks of a node are
consecutive worker tasks: with 2 tasks per node for cells, a replica's cells
share a node. Rank r serves port --slurm_port_base + r (TensorFlow's resolver
numbers ports per node; one port per rank keeps the ports of a job step
distinct, also when two "nodes" are one machine).
"""

import dataclasses
import json
import os
from typing import Dict
from typing import List
from typing import Mapping
from typing import Optional

from lingvo_ext.distributed import cluster

RESOLVERS = ('tf_config', 'slurm')
CHIEF_JOBS = 'controller,trainer_client'

_TF_CONFIG_FORMAT = (
    'JSON like {"cluster": {"chief": ["host:port"], "worker": ["host:port", '
    '...], "ps": [...]}, "task": {"type": "worker", "index": 0}}')
_SLURM_VARS = ('SLURM_PROCID', 'SLURM_STEP_NUM_TASKS', 'SLURM_STEP_NODELIST',
               'SLURM_STEP_TASKS_PER_NODE')


class ResolveError(ValueError):
  """The environment does not describe a usable cluster (message: one line)."""


@dataclasses.dataclass(frozen=True)
class Resolved:
  """This process's place in the cluster, in Lingvo's terms.

  Attributes:
    jobs: {job: [host:port]} for --cluster_spec (controller, worker, ps).
    job: This process's --job.
    task: This process's --task.
    source: What it was read from, e.g. 'TF_CONFIG'.
  """
  jobs: Dict[str, List[str]]
  job: str
  task: int
  source: str

  @property
  def cluster_spec(self) -> str:
    return cluster.FormatClusterSpec(self.jobs)

  def Flags(self) -> List[str]:
    """The trainer flags this resolves to."""
    return [f'--cluster_spec={self.cluster_spec}', f'--job={self.job}',
            f'--task={self.task}']


def _Jobs(chief: List[str], workers: List[str],
          ps: Optional[List[str]]) -> Dict[str, List[str]]:
  jobs = {'controller': list(chief), 'worker': list(workers)}
  if ps:
    jobs['ps'] = list(ps)
  # Same checks as --cluster_spec (addresses, one port per task).
  try:
    return cluster.ParseClusterSpec(cluster.FormatClusterSpec(jobs))
  except ValueError as e:
    message = str(e).replace('--cluster_spec', 'the cluster')
    raise ResolveError(message) from None


def _LingvoJob(task_type: str) -> str:
  return CHIEF_JOBS if task_type == 'chief' else task_type


def FromTFConfig(environ: Optional[Mapping[str, str]] = None) -> Resolved:
  """Resolves TF_CONFIG with TensorFlow's TFConfigClusterResolver.

  Args:
    environ: The environment (default: os.environ). TensorFlow's resolver
      reads os.environ, so another mapping is installed there while it runs.

  Returns:
    The `Resolved` cluster.

  Raises:
    ResolveError: naming TF_CONFIG and what it must hold.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  environ = os.environ if environ is None else environ
  text = environ.get('TF_CONFIG', '')
  if not text.strip():
    raise ResolveError(
        'TF_CONFIG is not set; --cluster_resolver=tf_config needs it to hold '
        f'{_TF_CONFIG_FORMAT} (Kubeflow\'s TFJob, JobSet, Vertex AI and '
        'SageMaker set it).')
  try:
    config = json.loads(text)
  except ValueError as e:
    raise ResolveError(f'TF_CONFIG is not valid JSON ({e}); it must hold '
                       f'{_TF_CONFIG_FORMAT}.') from None
  if not isinstance(config, dict) or not isinstance(
      config.get('cluster'), dict) or not isinstance(config.get('task'), dict):
    raise ResolveError('TF_CONFIG must be a JSON object with "cluster" and '
                       f'"task" objects: {_TF_CONFIG_FORMAT}.')
  saved = os.environ.get('TF_CONFIG')
  os.environ['TF_CONFIG'] = text
  try:
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    try:
      spec = resolver.cluster_spec().as_dict()
      task_type, task_id = resolver.task_type, resolver.task_id
    except (ValueError, TypeError, KeyError) as e:
      raise ResolveError(f'TF_CONFIG: {e}; it must hold '
                         f'{_TF_CONFIG_FORMAT}.') from None
  finally:
    if saved is None:
      del os.environ['TF_CONFIG']
    else:
      os.environ['TF_CONFIG'] = saved
  spec = {job: (list(tasks.values()) if isinstance(tasks, dict) else
                list(tasks)) for job, tasks in spec.items()}
  unknown = sorted(set(spec) - {'chief', 'worker', 'ps'})
  if unknown:
    raise ResolveError(
        f'TF_CONFIG\'s cluster has job(s) {", ".join(unknown)}, which '
        'lingvo_ext does not map; list only "chief" (one task: the controller '
        'and trainer client), "worker" (one per pipeline cell of each replica) '
        'and optionally "ps".')
  if len(spec.get('chief', [])) != 1:
    raise ResolveError(
        'TF_CONFIG\'s cluster must list exactly one "chief" task (the process '
        'that runs Lingvo\'s controller and trainer client); it lists '
        f'{len(spec.get("chief", []))}.')
  if not spec.get('worker'):
    raise ResolveError(
        'TF_CONFIG\'s cluster lists no "worker" task; it needs one per '
        'pipeline cell of each replica (--worker_split_size x replicas).')
  if task_type not in spec:
    raise ResolveError(
        f'TF_CONFIG\'s task type is {task_type!r}; it must be one of the '
        f'cluster\'s jobs ({", ".join(sorted(spec))}), e.g. "task": '
        '{"type": "worker", "index": 0}.')
  if task_id is None or not 0 <= task_id < len(spec[task_type]):
    raise ResolveError(
        f'TF_CONFIG\'s task index is {task_id} but its cluster lists '
        f'{len(spec[task_type])} {task_type!r} task(s); use 0..'
        f'{len(spec[task_type]) - 1}.')
  jobs = _Jobs(spec['chief'], spec['worker'], spec.get('ps'))
  return Resolved(jobs, _LingvoJob(task_type), task_id, 'TF_CONFIG')


def FromSlurm(port_base: int = 8888,
              environ: Optional[Mapping[str, str]] = None) -> Resolved:
  """Resolves a Slurm task's environment with TensorFlow's SlurmClusterResolver.

  Args:
    port_base: Rank r serves port port_base + r.
    environ: The environment (default: os.environ); installed in os.environ
      while TensorFlow's resolver reads it.

  Returns:
    The `Resolved` cluster: rank 0 the chief, rank 1+i worker i.

  Raises:
    ResolveError: naming the SLURM_* variable and what it must hold.
  """
  from lingvo_ext._internal import tf as internal_tf  # pylint: disable=g-import-not-at-top
  slurm = internal_tf.SlurmClusterResolverModule()
  environ = os.environ if environ is None else environ
  what = ('the environment of a task started by srun (' +
          ', '.join(_SLURM_VARS) + ')')
  for name in _SLURM_VARS:
    if not environ.get(name, '').strip():
      raise ResolveError(f'{name} is not set; --cluster_resolver=slurm needs '
                         f'{what}: run the trainer under srun.')
  for name in ('SLURM_PROCID', 'SLURM_STEP_NUM_TASKS'):
    if not environ[name].strip().isdigit():
      raise ResolveError(f'{name}={environ[name]!r} must be a number '
                         f'(Slurm sets it for each task).')
  rank = int(environ['SLURM_PROCID'])
  num_tasks = int(environ['SLURM_STEP_NUM_TASKS'])
  if num_tasks < 2:
    raise ResolveError(
        f'SLURM_STEP_NUM_TASKS={num_tasks}: the step needs 1 + R*K tasks '
        '(a chief, then one worker per pipeline cell of each replica), e.g. '
        'srun --ntasks=5 for 2 replicas x 2 cells.')
  if rank >= num_tasks:
    raise ResolveError(f'SLURM_PROCID={rank} must be below '
                       f'SLURM_STEP_NUM_TASKS={num_tasks}.')
  try:
    hosts = slurm.expand_hostlist(environ['SLURM_STEP_NODELIST'])
  except ValueError as e:
    raise ResolveError(f'SLURM_STEP_NODELIST: {e}; it must be a Slurm '
                       'hostlist such as node[01-02].') from None
  try:
    per_node = slurm.expand_tasks_per_node(environ['SLURM_STEP_TASKS_PER_NODE'])
  except ValueError as e:
    raise ResolveError(f'SLURM_STEP_TASKS_PER_NODE: {e}; it must be a Slurm '
                       'task count list such as 2(x2).') from None
  if len(per_node) != len(hosts) or sum(per_node) != num_tasks:
    raise ResolveError(
        f'SLURM_STEP_TASKS_PER_NODE={environ["SLURM_STEP_TASKS_PER_NODE"]!r} '
        f'must give one count per node of SLURM_STEP_NODELIST ({len(hosts)} '
        f'node(s)) adding up to SLURM_STEP_NUM_TASKS={num_tasks}.')
  saved = {k: os.environ.get(k) for k in _SLURM_VARS}
  os.environ.update({k: environ[k] for k in _SLURM_VARS})
  try:
    # CPU tasks: one pseudo GPU per task satisfies the resolver's GPU split;
    # auto_set_gpu=False leaves CUDA_VISIBLE_DEVICES alone.
    resolver = slurm.SlurmClusterResolver(
        jobs={'chief': 1, 'worker': num_tasks - 1}, port_base=port_base,
        gpus_per_node=max(per_node), gpus_per_task=1, auto_set_gpu=False)
    spec = resolver.cluster_spec().as_dict()
    task_type, task_id = resolver.get_task_info()
  except RuntimeError as e:
    raise ResolveError(f'Slurm environment: {e}; it must be {what}.') from None
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  # Ranks go to jobs in sorted job order: chief (rank 0), then workers.
  chief = [f'{cluster.Host(spec["chief"][0])}:{port_base}']
  workers = [f'{cluster.Host(a)}:{port_base + 1 + i}'
             for i, a in enumerate(spec['worker'])]
  if port_base + num_tasks > 65536 or port_base < 1:
    raise ResolveError(f'--slurm_port_base={port_base}: ports {port_base}..'
                       f'{port_base + num_tasks - 1} must be within 1..65535.')
  return Resolved(_Jobs(chief, workers, None), _LingvoJob(task_type), task_id,
                  'Slurm')


def Resolve(name: str, port_base: int = 8888,
            environ: Optional[Mapping[str, str]] = None) -> Resolved:
  """`FromTFConfig` or `FromSlurm` by --cluster_resolver's value."""
  if name == 'tf_config':
    return FromTFConfig(environ)
  if name == 'slurm':
    return FromSlurm(port_base, environ)
  raise ResolveError(f'--cluster_resolver={name} is not one of '
                     f'{", ".join(RESOLVERS)}.')


def TFConfig(jobs: Dict[str, List[str]], task_type: str, index: int) -> str:
  """The TF_CONFIG of one task; jobs in TF_CONFIG's names (chief, ...)."""
  return json.dumps({'cluster': jobs,
                     'task': {'type': task_type, 'index': index}})


def SlurmEnv(hosts: List[str], tasks_per_node: List[int],
             rank: int) -> Dict[str, str]:
  """The SLURM_* variables srun gives task `rank` of a block-distributed step.

  Args:
    hosts: The step's nodes, in order.
    tasks_per_node: Tasks on each node.
    rank: The task's rank (SLURM_PROCID).
  """
  node, first = 0, 0
  while rank >= first + tasks_per_node[node]:
    first += tasks_per_node[node]
    node += 1
  counts, runs = [], []
  for n in tasks_per_node:  # Slurm's compressed form: 2(x2),1.
    if runs and runs[-1][0] == n:
      runs[-1][1] += 1
    else:
      runs.append([n, 1])
  for n, times in runs:
    counts.append(f'{n}(x{times})' if times > 1 else str(n))
  nodelist = ','.join(hosts)
  return {
      'SLURM_JOB_ID': '1',
      'SLURM_STEP_ID': '0',
      'SLURM_PROCID': str(rank),
      'SLURM_LOCALID': str(rank - first),
      'SLURM_NODEID': str(node),
      'SLURMD_NODENAME': hosts[node],
      'SLURM_NTASKS': str(sum(tasks_per_node)),
      'SLURM_STEP_NUM_TASKS': str(sum(tasks_per_node)),
      'SLURM_STEP_NUM_NODES': str(len(hosts)),
      'SLURM_JOB_NODELIST': nodelist,
      'SLURM_STEP_NODELIST': nodelist,
      'SLURM_TASKS_PER_NODE': ','.join(counts),
      'SLURM_STEP_TASKS_PER_NODE': ','.join(counts),
  }
