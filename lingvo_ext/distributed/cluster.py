"""How the processes of a --cluster_spec map onto Lingvo's cluster.

Lingvo's trainer reads a cluster spec like

  controller=h0:2220@trainer_client=h0:2221@worker=h1:2222,h2:2222

and, in --mode=sync, makes every worker task a replica with
--worker_split_size devices of its own: a model split (the devices one copy
of the model is pipelined over) never leaves a process. `WorkerLayout` maps
splits across processes instead. The worker job's devices, listed in task
order (task 0's devices, then task 1's, ...), are cut into consecutive model
splits of --worker_split_size devices; each split is one data-parallel
replica:

  replica r, cell i  ->  device r * K + i of that list    (K = split size)

With one device per worker task (the default) that is

  replica r, cell i  ->  /job:worker/replica:0/task:(r * K + i)/device:CPU:0

so R replicas of a K-cell pipeline run on R * K worker processes. It is the
same device list and the same order that a single process with R * K logical
devices has, so a multi-process run computes what the single-process run
with --num_cpu_devices=R*K --worker_split_size=K computes.

Lingvo's `Cluster.ListDevices` already sorts a job's devices by
(replica, task, device) and reshapes them into [replicas, devices per
replica], so the mapping is just cluster params: worker.replicas = R,
worker.cpus_per_replica = worker.devices_per_split = K. Variables go to the
ps job, which in sync mode is the worker job itself: ps.replicas = worker
tasks, ps.cpus_per_replica = devices per task. The input pipeline (a
tf.numpy_function, which runs only in the process that defined it) goes to
the building client's own server, e.g. input = /job:trainer_client.
"""

import dataclasses
import errno
import socket
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

# The job each --mode needs in the cluster spec beside the processes' own.
_MODE_JOBS = {'sync': ('worker',), 'async': ('trainer', 'ps')}


def ParseClusterSpec(spec: str) -> Dict[str, List[str]]:
  """Parses 'job=host:port,host:port@job2=...' into {job: [addresses]}.

  Args:
    spec: The --cluster_spec flag's value.

  Returns:
    An ordered dict from job name to its tasks' host:port addresses.

  Raises:
    ValueError: for a malformed spec, naming the bad part and the format.
  """
  jobs = {}
  for part in spec.split('@'):
    name, sep, hosts = part.partition('=')
    name = name.strip()
    addresses = [h.strip() for h in hosts.split(',')] if sep else []
    if not name or not addresses or not all(addresses):
      raise ValueError(
          f'--cluster_spec: bad job {part!r}; write job=host:port[,host:port]'
          '[@job=...], e.g. --cluster_spec=controller=127.0.0.1:2220@'
          'trainer_client=127.0.0.1:2221@worker=127.0.0.1:2222,'
          '127.0.0.1:2223')
    for a in addresses:
      host, _, port = a.rpartition(':')
      if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f'--cluster_spec: bad address {a!r} in job {name!r}; '
                         'write host:port, e.g. 127.0.0.1:2222')
    if name in jobs:
      raise ValueError(f'--cluster_spec: job {name!r} is given twice; list '
                       'all its tasks once, comma-separated.')
    jobs[name] = addresses
  seen = {}
  for name, addresses in jobs.items():
    for task, a in enumerate(addresses):
      if a in seen:
        raise ValueError(
            f'--cluster_spec: {seen[a]} and {name} task {task} both use '
            f'{a}; two processes cannot serve one port: give each task its '
            'own port.')
      seen[a] = f'{name} task {task}'
  return jobs


def FormatClusterSpec(jobs: Dict[str, Sequence[str]]) -> str:
  """The --cluster_spec value of {job: [addresses]}."""
  return '@'.join(f'{job}={",".join(hosts)}' for job, hosts in jobs.items())


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
  """Where the replicas and cells of a model go among the worker tasks.

  Attributes:
    num_tasks: Worker tasks (processes) in the cluster spec.
    devices_per_task: Devices each worker task offers.
    split_size: Devices per model split (--worker_split_size): cells of one
      replica's pipeline.
  """
  num_tasks: int
  devices_per_task: int
  split_size: int

  @property
  def num_replicas(self) -> int:
    return self.num_tasks * self.devices_per_task // self.split_size

  def Device(self, replica: int, cell: int, job: str = 'worker',
             device_type: str = 'CPU') -> str:
    """The device of `cell` (index within the split) of `replica`."""
    index = replica * self.split_size + cell % self.split_size
    task, device = divmod(index, self.devices_per_task)
    return f'/job:{job}/replica:0/task:{task}/device:{device_type}:{device}'

  def Task(self, replica: int, cell: int) -> int:
    """The worker task that runs `cell` of `replica`."""
    index = replica * self.split_size + cell % self.split_size
    return index // self.devices_per_task


def MakeWorkerLayout(num_tasks: int, devices_per_task: int,
                     split_size: int) -> WorkerLayout:
  """Checks the numbers and returns their `WorkerLayout`.

  Raises:
    ValueError: naming the flag and the fix when the devices cannot be cut
      into whole splits.
  """
  total = num_tasks * devices_per_task
  if split_size < 1:
    raise ValueError(f'--worker_split_size={split_size} must be >= 1.')
  if split_size > total:
    raise ValueError(
        f'--worker_split_size={split_size} is larger than the {total} '
        f'device(s) the workers offer ({num_tasks} worker task(s) in '
        f'--cluster_spec x {devices_per_task} device(s) each); add worker '
        'tasks to --cluster_spec (or devices per worker with '
        '--num_cpu_devices), or lower --worker_split_size.')
  if total % split_size:
    raise ValueError(
        f'--worker_split_size={split_size} does not divide the {total} '
        f'devices the workers offer ({num_tasks} worker task(s) x '
        f'{devices_per_task}); use a worker count that is a multiple of it, '
        f'e.g. {split_size * max(1, total // split_size)} worker tasks.')
  return WorkerLayout(num_tasks, devices_per_task, split_size)


def CheckClusterFlags(jobs: Dict[str, List[str]], mode: str,
                      process_jobs: Sequence[str], task: int) -> None:
  """Checks that the cluster spec has what --mode and --job need.

  Args:
    jobs: The parsed --cluster_spec.
    mode: --mode.
    process_jobs: This process's --job, split at ','.
    task: --task.

  Raises:
    ValueError: naming the missing job or bad task, and the fix.
  """
  for job in _MODE_JOBS.get(mode, ()):
    if job not in jobs:
      raise ValueError(
          f'--cluster_spec has no {job!r} job, which --mode={mode} needs; '
          f'add @{job}=host:port[,host:port...] (one address per {job} '
          f'process), e.g. --cluster_spec=...@{job}=127.0.0.1:2222')
  # A process serves its first job; the others (e.g. the trainer client
  # beside a controller) run on that server and need no address.
  for job in process_jobs[:1]:
    if job not in jobs:
      raise ValueError(
          f'--job={job} but --cluster_spec has no {job!r} job (it has '
          f'{", ".join(jobs)}); add @{job}=host:port for this process.')
    if not 0 <= task < len(jobs[job]):
      raise ValueError(
          f'--task={task} but --cluster_spec lists {len(jobs[job])} '
          f'{job!r} task(s); use --task=0..{len(jobs[job]) - 1} or add its '
          'address to the job.')


def UpdateClusterParams(cluster_p, layout: WorkerLayout,
                        jobs: Dict[str, List[str]], devices_per_task: int,
                        client_job: Optional[str] = None) -> None:
  """Sets Lingvo cluster params `cluster_p` (sync mode) to `layout`.

  Args:
    cluster_p: A `cluster_factory.Cluster.Params()` already set from the
      trainer flags (job names, task, mode).
    layout: Where replicas and cells go.
    jobs: The parsed --cluster_spec.
    devices_per_task: CPU devices per task of every job (--num_cpu_devices).
    client_job: The job of the process building the graph (controller,
      trainer_client); its input pipeline runs on its own server.
  """
  w = cluster_p.worker
  w.replicas = layout.num_replicas
  if w.gpus_per_replica:
    w.gpus_per_replica = layout.split_size
  else:
    w.cpus_per_replica = layout.split_size
  w.devices_per_split = layout.split_size
  ps = cluster_p.ps
  if ps.name == w.name:
    ps.replicas = layout.num_tasks
    ps.cpus_per_replica = devices_per_task
  cluster_p.controller.cpus_per_replica = devices_per_task
  if client_job in jobs and cluster_p.input.replicas == 0:
    # A tf.numpy_function runs only in the process that defined it.
    cluster_p.input.name = f'/job:{client_job}'
    cluster_p.input.replicas = 1
    cluster_p.input.cpus_per_replica = devices_per_task


def Host(address: str) -> str:
  return address.rpartition(':')[0].strip('[]')


def Port(address: str) -> int:
  return int(address.rpartition(':')[2])


def Answers(address: str, timeout_s: float = 2) -> bool:
  """Whether `address` accepts a TCP connection now."""
  try:
    with socket.create_connection((Host(address), Port(address)),
                                  timeout=timeout_s):
      return True
  except OSError:
    return False


def CheckPortFree(address: str, what: str) -> None:
  """Raises ValueError if another process already listens on `address`.

  TensorFlow's gRPC server reports a taken port only as 'Could not start gRPC
  server'. Binding a plain socket (no SO_REUSEPORT) to the wildcard address
  finds the listener whichever interface it bound.
  """
  port = Port(address)
  for family, host in ((socket.AF_INET6, '::'), (socket.AF_INET, '0.0.0.0')):
    try:
      s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
      continue
    try:
      # SO_REUSEADDR: a port whose last server died (connections in
      # TIME_WAIT) is free; one with a live listener is not.
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.bind((host, port))
      return
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        raise ValueError(
            f'port {port} of {what} ({address} in --cluster_spec) is already '
            'in use by another process; stop that process or give this task '
            'another port in --cluster_spec.') from None
      if e.errno != errno.EAFNOSUPPORT:
        raise
    finally:
      s.close()


def WaitForAddresses(addresses: Dict[str, str], timeout_s: float,
                     poll_s: float = 0.5) -> None:
  """Waits until every address accepts a TCP connection.

  Args:
    addresses: {'worker task 1': 'host:port', ...}.
    timeout_s: Give up after this many seconds.
    poll_s: Seconds between tries.

  Raises:
    TimeoutError: naming the tasks and addresses that never answered.
  """
  pending = dict(addresses)

  def AllAnswered():
    for what, address in list(pending.items()):
      try:
        with socket.create_connection((Host(address), Port(address)),
                                      timeout=min(poll_s * 4, 2)):
          del pending[what]
      except OSError:
        pass
    return not pending

  if not PollUntil(AllAnswered, timeout_s, poll_s):
    raise TimeoutError(
        'no answer within --cluster_wait_secs=%g s from %s; start those '
        'processes (.venv/bin/python -m lingvo_ext.trainer --cluster_spec=... '
        '--job=JOB --task=N), or fix their addresses in --cluster_spec.' %
        (timeout_s, ', '.join(f'{w} at {a}' for w, a in pending.items())))


def PollUntil(done, timeout_s, poll_s):
  """Calls done() every poll_s seconds until it is true or timeout_s passed.

  done() is called at least once, and once more after the deadline.

  Returns:
    Whether done() returned true.
  """
  import time  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + timeout_s
  while True:
    if done():
      return True
    if time.monotonic() > deadline:
      return False
    time.sleep(poll_s)


def TaskOfDevice(device: str) -> Optional[str]:
  """'worker task 1' for a device or error text naming /job:worker/.../task:1."""
  import re  # pylint: disable=g-import-not-at-top
  m = re.search(r'/job:(\w+)/replica:\d+/task:(\d+)', device)
  return f'{m.group(1)} task {m.group(2)}' if m else None
