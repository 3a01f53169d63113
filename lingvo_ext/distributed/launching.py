"""The launcher's run: its network, its cluster, and smaller clusters after a
worker is lost for good (elastic.py).

`Launch` is what `lingvo_ext.launch` calls: it enters the private network
namespace (or warns of --network=host), starts the cluster (launch_lib's
Launcher), forwards a stop signal, and stops every process at the end. When
the Launcher reports a worker lost for good and --elastic is on, it stops
that cluster at once (the lost worker's variables are gone: there is nothing
to save), takes the plan for the devices left (lingvo_ext.tools.replan, run
niced in a process of its own while the cluster trains, forked from the
tasks' fork server where it can be: the loss waits for no planning), and
starts the smaller cluster on the same logdir with the new plan's
flags, which resumes from the newest complete checkpoint. The fork server is
shared by the clusters of one run.
"""

import json
import os
import re
import signal
import subprocess
import sys
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import cluster_tasks
from lingvo_ext.distributed import elastic
from lingvo_ext.distributed import fork_server
from lingvo_ext.distributed import launch_lib
from lingvo_ext.distributed import network

# A re-plan probes the machine's memory once (memory_probe: minutes) and is
# cached after that.
REPLAN_TIMEOUT_S = 900
_MODULES = ('lingvo_ext.trainer', 'lingvo_ext.tools.replan')


def FlagValue(flags: Sequence[str], name: str, default=None):
  """The last --name=VALUE of `flags`, or `default`."""
  value = default
  for f in flags:
    if f.startswith(f'--{name}='):
      value = f.split('=', 1)[1]
  return value


def _EnterNetwork(kind: str, say) -> bool:
  if kind == 'private':
    try:
      network.EnterPrivateNetwork()
    except OSError as e:
      say(f'error: --network=private: cannot make a private network '
          f'namespace here ({e}); run with --network=host to run the cluster '
          'on this host\'s network (its gRPC ports then accept connections '
          'from every interface).')
      return False
    say('launch: TensorFlow\'s gRPC servers listen on all interfaces; this '
        'cluster runs in a private network namespace with only 127.0.0.1, so '
        'nothing outside this launcher can reach its ports.')
  else:
    say('launch: WARNING --network=host: TensorFlow\'s gRPC servers listen on '
        'all interfaces of this host and do no authentication; anyone who can '
        'reach these ports can run code in these processes.')
  return True


def _SayLayout(layout, say) -> None:
  if layout:
    say('launch: %d replica(s) x %d cell(s): %s' % (
        layout.num_replicas, layout.split_size, '; '.join(
            f'replica {r} cell {i} on {layout.Device(r, i)}'
            for r in range(layout.num_replicas)
            for i in range(layout.split_size))))


def _StartReplan(server, trainer_flags: List[str], devices_left: int,
                 replicas: int, devices_per_worker: int, nodes: int,
                 log_dir: str):
  """Starts tools/replan.py for `devices_left` devices, niced: a handle for
  _ReplanResult."""
  argv = [sys.executable, '-m', 'lingvo_ext.tools.replan',
          f'--model={FlagValue(trainer_flags, "model")}',
          f'--devices={devices_left}', f'--replicas={replicas}',
          '--model_params_override=' +
          FlagValue(trainer_flags, 'model_params_override', ''),
          f'--devices_per_worker={devices_per_worker}', f'--nodes={nodes}',
          '--nice', '--json']
  out = os.path.join(log_dir, 'replan.out')
  err = os.path.join(log_dir, 'replan.log')
  for path in (out, err):
    open(path, 'w').close()  # pylint: disable=consider-using-with
  proc = server.Spawn(argv, dict(os.environ), out, err) if server else None
  if proc is None:
    with open(out, 'ab') as o, open(err, 'ab') as e:
      proc = subprocess.Popen(argv, stdout=o, stderr=e,
                              stdin=subprocess.DEVNULL,
                              start_new_session=True)
  return (devices_left, replicas), proc, out, err


def _ReplanResult(handle) -> Tuple[Optional[dict], str]:
  """(the new plan as tools/replan.py's --json, '') or (None, why)."""
  _, proc, out, err = handle
  try:
    rc = proc.wait(REPLAN_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    rc = None
  finally:
    _StopReplan(handle)
  if rc is None:
    return None, (f'the re-plan did not finish within {REPLAN_TIMEOUT_S} s '
                  f'(its log: {err})')
  with open(err) as f:
    errors = [l.strip() for l in f if l.startswith('error:')]
  with open(out) as f:
    text = f.read().strip().splitlines()
  if rc == 0 and text:
    try:
      return json.loads(text[-1]), ''
    except ValueError:
      pass
  why = errors[-1][len('error:'):].strip() if errors else (
      f'the re-plan exited with {launch_lib.SignalName(rc)} (its log: {err})')
  return None, why


def _StopReplan(handle) -> None:
  if handle and handle[1].poll() is None:
    launch_lib.KillGroup(handle[1], signal.SIGKILL)


def NewestCheckpoint(logdir: str) -> Optional[str]:
  """The checkpoint LOGDIR/train's state file names (the one the trainer
  restores), by its basename; None if there is none."""
  try:
    with open(os.path.join(logdir, 'train', 'checkpoint')) as f:
      m = re.search(r'^model_checkpoint_path: "([^"]+)"', f.read(), re.M)
  except OSError:
    return None
  return os.path.basename(m.group(1)) if m else None


def _RunCluster(launcher, grace_s: float, preempted_code: int,
                interrupted: List[int]) -> int:
  """Runs one cluster to its end; its exit code (EXIT_LOST: re-plan)."""
  rc = 1
  try:
    try:
      launcher.StartAll()
      launcher.WaitReady()
      rc = launcher.Watch()
      if rc == launch_lib.EXIT_INPUT_BROKE:
        launcher.SaveAfterInputFault(grace_s)
      return rc
    except KeyboardInterrupt:
      signum = interrupted[0] if interrupted else signal.SIGINT
      try:
        saved = launcher.Shutdown(signum, grace_s, preempted_code)
      except KeyboardInterrupt:  # A second signal: stopped at once.
        saved = False
      if signum == signal.SIGINT:
        return 130
      return preempted_code if saved else launch_lib.EXIT_NOT_SAVED
  except (RuntimeError, TimeoutError) as e:
    launcher.Print(f'error: {e}')
    return 1
  finally:
    # A lost worker's variables are gone: nothing is left to save.
    launcher.StopAll(0.5 if rc == launch_lib.EXIT_LOST else 10)
    if rc != launch_lib.EXIT_LOST:
      launcher.Print('launch: stopped all %d processes.' %
                     len(launcher.tasks))
    launcher.Flush()


def Launch(num_workers: int, trainer_flags: Sequence[str], logdir: str,
           network_kind: str = 'private', ready_timeout_s: float = 120,
           max_restarts: int = 3, out=None, stream_logs: bool = False,
           cluster_from: str = 'flags', num_ps: int = 0, nodes: int = 1,
           layout: Optional[cluster.WorkerLayout] = None,
           fork_tasks: bool = True, shutdown_grace_s: float = 20,
           task_timeout_s: float = 60, preempted_code: int = 0,
           elastic_on: bool = True) -> int:
  """Runs a local cluster until training ends; returns the exit code.

  Exit codes: 0 training finished, or stopped by SIGTERM/SIGHUP after the
  controller saved the last step; 1 a task failed (with `elastic_on`: a
  worker lost for good where no plan fits the devices left); 2 bad flags,
  or a task refused its input; 4 an evaluation failed; 65 input files
  broke; 74 a task found the disk full; 130 Ctrl-C; 137 the OOM killer
  ended a task; 143 SIGTERM/SIGHUP without the last save
  (docs/preemption.md, docs/faults.md). `preempted_code`
  (--preempted_exit_code, which the tasks exit with too) takes 0's place
  after a stop signal's save.
  """
  out = out or sys.stdout

  def Say(line):
    out.write(line + '\n')
    out.flush()

  if not _EnterNetwork(network_kind, Say):
    return 2
  flags = list(trainer_flags)
  devices_per_worker = int(FlagValue(flags, 'num_cpu_devices', '1'))
  log_dir = os.path.join(logdir, 'launch')
  os.makedirs(log_dir, exist_ok=True)
  interrupted, current = [], []

  def OnSignal(signum, frame):
    del frame
    interrupted.append(signum)
    if len(interrupted) > 1 and current:  # A second one: stop at once.
      for t in current[-1].tasks:
        if t.proc:
          launch_lib.KillGroup(t.proc, signal.SIGKILL)
    raise KeyboardInterrupt

  old = {s: signal.signal(s, OnSignal) for s in (signal.SIGTERM,
                                                  signal.SIGHUP)}
  server = None
  try:
    if fork_tasks:
      server = fork_server.ForkServer(
          _MODULES, os.path.join(log_dir, 'fork_server.stderr'))
      why = server.Start(ready_timeout_s)
      if why:
        Say(f'launch: starting each task as a fresh interpreter: {why}')
        server = None
      else:
        Say(f'launch: forking the tasks from pid {server.pid}, which has '
            'imported TensorFlow and Lingvo (--fork_tasks=false: a fresh '
            'interpreter each)')
    since_loss, replan = None, None
    while True:
      _SayLayout(layout, Say)
      split = int(FlagValue(flags, 'worker_split_size', '1'))
      if elastic_on and num_workers > 1:
        # The plan for one worker fewer, made while this cluster trains.
        replan = _StartReplan(
            server, flags, (num_workers - 1) * devices_per_worker,
            elastic.Replicas(num_workers, devices_per_worker, split),
            devices_per_worker, nodes if cluster_from == 'slurm' else 1,
            log_dir)
      tasks = cluster_tasks.ClusterTasks(num_workers, flags, cluster_from,
                                         num_ps, nodes)
      launcher = launch_lib.Launcher(
          tasks, logdir, ready_timeout_s, max_restarts, out, stream_logs,
          server is not None, task_timeout_s, elastic=elastic_on,
          shared_fork_server=server, since_loss=since_loss)
      current.append(launcher)
      rc = _RunCluster(launcher, shutdown_grace_s, preempted_code,
                       interrupted)
      if rc != launch_lib.EXIT_LOST:
        return rc
      loss, since_loss = launcher.lost, launcher.lost_at
      decision = elastic.Decide(loss, num_workers, devices_per_worker, split,
                                elastic_on)
      got, why = None, decision.why
      if decision.action == elastic.REPLAN:
        try:
          got, why = _ReplanResult(replan)
        except KeyboardInterrupt:
          launcher.Print('launch: stopped while re-planning; the last '
                         'complete checkpoint is the latest.')
          return (130 if not interrupted or interrupted[0] == signal.SIGINT
                  else launch_lib.EXIT_NOT_SAVED)
      if got is None:
        launcher.Print(f'error: {loss.what} is lost for good ({loss.why}) '
                       f'and the cluster cannot go on without it: {why}. '
                       'Stopping the cluster.')
        launcher.Print(f'launch: stopped all {len(tasks)} processes.')
        launcher.Flush()
        return 1
      num_workers = got['workers']
      flags = elastic.ReplannedFlags(flags, got['model_params_override'],
                                     got['num_cpu_devices'],
                                     got['worker_split_size'])
      layout = cluster.MakeWorkerLayout(num_workers, got['num_cpu_devices'],
                                        got['worker_split_size'])
      launcher.Print(elastic.LossLine(
          loss, num_workers, got['cells'], got['devices'],
          got['micro_batches'], NewestCheckpoint(logdir)))
      launcher.Flush()
  finally:
    _StopReplan(replan)
    if server:
      server.Close()
    for s, handler in old.items():
      signal.signal(s, handler)
