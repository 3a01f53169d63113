"""GPipe step time in one process vs across 2 worker processes over gRPC.

The homogeneous FC model of bench/pipeline.py (8 layers, K=2 cells, M=4
micro-batches, lingvo_ext's PipeliningLayer) trains with the same graph
built two ways, side by side in one run:

  (a) local:   one process, 2 logical CPU devices (cell i on CPU:i);
  (b) cluster: 2 worker processes (TensorFlow gRPC servers on loopback), cell
      i and its variables on worker task i (PipeliningLayer's
      colocate_cell_variables=True, the default), the step driven by a client
      process, with lingvo_ext.distributed.cluster's mapping;
  (c) the same cluster with colocate_cell_variables=False: Lingvo's
      least-loaded placer spreads the variables over both tasks, as
      lingvo.core.gpipe does.

Each worker process has 1 inter-op and 1 intra-op thread on 2 cores, as do
the 2 devices of (a) together. Each SGD update runs on its variable's
device, as Lingvo's optimizers do. Timed steps alternate (a), (b) and (c);
medians are reported. Bytes between processes per step come from the step
stats of a traced step (the _Recv ops whose sender is on another task), next to what
the activation shapes predict: per micro-batch the forward activation
(batch/M x width floats) goes from cell 0 to cell 1 and its gradient back.
The whole run is in a private network namespace (loopback only).

  python bench/cluster.py            # width 1536, batch 128, 20 steps
  python bench/cluster.py --quick    # width 256, batch 32, 10 steps
  python bench/cluster.py --dtype float32,bfloat16   # both, side by side

With --dtype bfloat16 the pipeline is built with fprop_dtype=tf.bfloat16
(Lingvo's mixed precision: float32 variables and updates, bfloat16 cells):
the activations and gradients between the processes are bfloat16. With
several dtypes every (kind, dtype) step is timed in the same round-robin and
one record per dtype is printed, the bfloat16 one with its ratios to
float32's.

  python bench/cluster.py --recovery   # a worker lost for good, recovered

--recovery runs `lingvo_ext.launch` on lm.TransformerLmTinyGPipe over 2
workers (--max_restarts=1, a checkpoint a second), kills worker task 1 past
step 30 and at its restart, and reports the launcher's time from the loss to the first step the
re-planned 1-worker cluster trains (its `launch: recovered:` line; the
trainer prints its progress line every 2 s, so the figure is within 2 s
late), against the target of 60 s on a 2-core machine.
"""

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

# Before TensorFlow starts any thread: the namespace needs one thread.
from bench import harness  # pylint: disable=g-import-not-at-top,g-bad-import-order
from lingvo_ext.distributed import network  # pylint: disable=g-import-not-at-top,g-bad-import-order

_WORKER = r'''
import sys, time
import tensorflow as tf
cfg = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1,
                               intra_op_parallelism_threads=1)
cluster = tf.train.ClusterSpec({'client': [sys.argv[1]],
                                'worker': sys.argv[2].split(',')})
tf.distribute.Server(cluster, job_name='worker', task_index=int(sys.argv[3]),
                     config=cfg).join()
'''


def Markdown(records) -> str:
  """Every field of the records (float32, then bfloat16), a row each."""
  keys = list(records[0])
  return harness.Table(keys, [[r.get(k, '-') for k in keys] for r in records])


def _Args(argv=None):
  p = harness.Parser(__doc__)
  p.add_argument('--quick', action='store_true')
  p.add_argument('--width', type=int, default=None)
  p.add_argument('--batch', type=int, default=None)
  p.add_argument('--steps', type=int, default=None)
  p.add_argument('--micro_batches', type=int, default=4)
  p.add_argument('--network', choices=('private', 'host'), default='private')
  p.add_argument('--dtype', default='float32',
                 help="float32 (default), bfloat16, or float32,bfloat16.")
  p.add_argument('--recovery', action='store_true',
                 help='Time the recovery from a worker lost for good.')
  args = p.parse_args(argv)
  args.dtype = [d.strip() for d in args.dtype.split(',') if d.strip()]
  if not args.dtype or set(args.dtype) - {'float32', 'bfloat16'}:
    p.error('--dtype: give float32, bfloat16 or float32,bfloat16')
  width, batch, steps = (256, 32, 10) if args.quick else (1536, 128, 20)
  args.width = args.width or width
  args.batch = args.batch or batch
  args.steps = args.steps or steps
  return args


RECOVERY_TARGET_S = 60
_RECOVERED = re.compile(r'launch: recovered: step (\d+) trained ([\d.]+) s')
_STEP = re.compile(r'^\[trainer_client\] step (\d+)/', re.M)
# Worker task 1 is killed once training is past this step (and at its
# restart): the resumed checkpoint is one of training, not the first save.
KILL_AT_STEP = 30
_STARTED_1 = re.compile(r'launch: started worker task 1 \(\S+\) as pid (\d+)')


def Recovery(args, timeout_s: float = 600) -> int:
  """--recovery: the launcher's time from a worker's loss to the next step."""
  logdir = tempfile.mkdtemp(prefix='lx_recovery_')
  log = os.path.join(logdir, 'launch.out')
  argv = [sys.executable, '-m', 'lingvo_ext.launch',
          '--model=lm.TransformerLmTinyGPipe', f'--logdir={logdir}',
          '--workers=2', '--worker_split_size=2', '--max_steps=400',
          '--max_restarts=1', f'--network={args.network}',
          '--model_params_override=train.save_interval_seconds:1']
  load = os.getloadavg()
  killed = set()
  with open(log, 'w') as out:
    proc = subprocess.Popen(argv, cwd=_REPO, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
  try:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
      with open(log) as f:
        text = f.read()
      steps = [int(n) for n in _STEP.findall(text)]
      if steps and steps[-1] >= KILL_AT_STEP and 'lost for good' not in text:
        for pid in map(int, _STARTED_1.findall(text)):
          if pid not in killed:  # At its start and at every restart.
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
      time.sleep(0.1)
    rc = proc.wait(max(1, deadline - time.monotonic()))
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait(10)
  with open(log) as f:
    text = f.read()
  m = _RECOVERED.search(text)
  if rc != 0 or not m:
    print(f'error: the launcher exited {rc} without a recovery; its output: '
          f'{log}', file=sys.stderr)
    return 1
  shutil.rmtree(logdir, ignore_errors=True)
  seconds = float(m.group(2))
  harness.Emit(args, [dict(
      model='lm.TransformerLmTinyGPipe', workers='2 -> 1',
      recovery_s=seconds, target_s=RECOVERY_TARGET_S,
      ratio_to_target=round(seconds / RECOVERY_TARGET_S, 3),
      first_step_after=int(m.group(1)), load_at_start=round(load[0], 2),
      **harness.Machine())], Markdown)
  return 0


def main(argv=None):
  args = _Args(argv)
  if args.recovery:
    return Recovery(args)
  if args.network == 'private':
    network.EnterPrivateNetwork()
  # pylint: disable=g-import-not-at-top
  from lingvo_ext import entry_point  # pylint: disable=unused-import
  # isort: split
  import lingvo.compat as tf
  from lingvo.core import cluster_factory
  from lingvo.core import py_utils
  import numpy as np

  from bench import pipeline_step  # pylint: disable=g-import-not-at-top
  from lingvo_ext.core import gpipe
  from lingvo_ext.core import precision
  from lingvo_ext.distributed import cluster
  # pylint: enable=g-import-not-at-top
  py_utils.SetEagerMode(False)
  k, m = 2, args.micro_batches

  ports = network.FreePorts(3)
  client = f'127.0.0.1:{ports[0]}'
  workers = [f'127.0.0.1:{p}' for p in ports[1:]]
  jobs = {'client': [client], 'worker': workers}
  procs = [
      subprocess.Popen([sys.executable, '-c', _WORKER, client, ','.join(
          workers), str(t)], start_new_session=True) for t in range(k)
  ]
  try:
    cluster.WaitForAddresses({f'worker {t}': a for t, a in enumerate(workers)},
                             120)
    server = tf.distribute.Server(
        tf.train.ClusterSpec(jobs), job_name='client', task_index=0,
        config=tf.config_pb2.ConfigProto(inter_op_parallelism_threads=2,
                                         intra_op_parallelism_threads=1))

    def Build(kind, dtype):
      graph = tf.Graph()
      colocate = kind != 'least_loaded'
      if kind == 'local':
        target, config = '', pipeline_step.SessionConfig()
        cluster_p = cluster_factory.ForTestingWorker(
            mode='sync', job='trainer_client', cpus=k, split_size=k).params
        cluster_p.ps.cpus_per_replica = k
      else:
        target, config = server.target, None
        cluster_p = cluster_factory.Cluster.Params().Set(
            mode='sync', job='trainer_client')
        cluster_p.worker.name = cluster_p.ps.name = '/job:worker'
        cluster_p.input.name = '/job:client'
        cluster.UpdateClusterParams(
            cluster_p, cluster.MakeWorkerLayout(k, 1, k), jobs, 1, 'client')
      sess = tf.Session(target, graph=graph, config=config)
      c = cluster_p.Instantiate()
      c.InitDevices(sess)
      cells = pipeline_step.Cells('homogeneous', args.width, args.batch, k)
      with graph.as_default(), c, tf.device(c.GetPlacer()):
        tf.random.set_seed(1)
        py_utils.GetOrCreateGlobalStepVar()
        x = tf.cast(tf.constant(
            np.random.RandomState(0).randn(args.batch, args.width),
            dtype=tf.float32), dtype)
        bf16 = (dict(fprop_dtype=tf.bfloat16, state_dtype=tf.float32)
                if dtype == 'bfloat16' else {})
        net = gpipe.PipeliningLayer.Params().Set(
            name='pipe', cell_tpl=cells, num_micro_batches=m,
            colocate_cell_variables=colocate, **bf16).Instantiate()
        loss = tf.reduce_sum(
            tf.square(tf.cast(net.FPropDefaultTheta(x), tf.float32)))
        variables = net.vars.Flatten()
        grads = tf.gradients(loss, variables,
                             colocate_gradients_with_ops=True)
        updates = []
        for v, g in zip(variables, grads):
          with tf.device(v.device):
            updates.append(tf.assign_sub(v, pipeline_step.LEARNING_RATE * g))
        train = tf.group(*updates)
        sess.run(tf.global_variables_initializer())
      return sess, loss, train

    steps = {(kind, dtype): Build(kind, dtype)
             for dtype in args.dtype
             for kind in ('local', 'cluster', 'least_loaded')}
    first = {key: float(s.run(l)) for key, (s, l, _) in steps.items()}
    for (kind, dtype), f in first.items():
      if not np.isclose(first[('local', dtype)], f, rtol=1e-5):
        raise AssertionError(f'first losses differ: {first}')
    for _ in range(3):  # Warm-up.
      for sess, _, train in steps.values():
        sess.run(train)
    times = {kind: [] for kind in steps}
    for _ in range(args.steps):
      for kind, (sess, _, train) in steps.items():
        t = time.perf_counter()
        sess.run(train)
        times[kind].append(time.perf_counter() - t)

    def CrossProcessBytes(kind):
      """(bytes, receives) across processes in one traced step of `kind`."""
      sess, _, train = steps[kind]
      md = tf.RunMetadata()
      sess.run(
          train,
          options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
          run_metadata=md)
      cross = recvs = 0
      for dev in md.step_stats.dev_stats:
        me = re.search(r'/job:(\w+)/replica:\d+/task:(\d+)', dev.device)
        for node in dev.node_stats:
          if ('_Recv' not in node.timeline_label and
              'Recv' not in node.node_name):
            continue
          src = re.search(r'from (/job:\w+/replica:\d+/task:\d+)',
                          node.timeline_label)
          if not src or not me or src.group(1).endswith(
              f'/job:{me.group(1)}/replica:0/task:{me.group(2)}'):
            continue
          for out in node.output:
            cross += (
                out.tensor_description.allocation_description.requested_bytes)
          recvs += 1
      return cross, recvs

    records = {}
    for dtype in args.dtype:
      cross, recvs = CrossProcessBytes(('cluster', dtype))
      ll_cross, ll_recvs = CrossProcessBytes(('least_loaded', dtype))
      # One direction, all micro-batches.
      act = args.batch * args.width * (2 if dtype == 'bfloat16' else 4)
      local_ms = statistics.median(times[('local', dtype)]) * 1e3
      cluster_ms = statistics.median(times[('cluster', dtype)]) * 1e3
      ll_ms = statistics.median(times[('least_loaded', dtype)]) * 1e3
      records[dtype] = dict(
          model='homogeneous', dtype=dtype, width=args.width,
          batch=args.batch, K=k, M=m, steps=args.steps,
          local_ms=round(local_ms, 2), cluster_ms=round(cluster_ms, 2),
          ratio=round(cluster_ms / local_ms, 3),
          measured_cross_process_bytes_per_step=cross,
          measured_cross_process_recvs=recvs,
          least_loaded_cluster_ms=round(ll_ms, 2),
          least_loaded_ratio=round(ll_ms / local_ms, 3),
          least_loaded_cross_process_bytes_per_step=ll_cross,
          least_loaded_cross_process_recvs=ll_recvs,
          activation_bytes_per_step_fwd_plus_bwd=2 * act,
          activation_bytes_per_micro_batch=act // m,
          first_loss=first[('local', dtype)],
          onednn=bool(pipeline_step.OneDnnEnabled()),
          cpu_bf16_units=precision.CpuHasBf16Units())
    if 'float32' in records and 'bfloat16' in records:
      f, b = records['float32'], records['bfloat16']
      for key in ('local_ms', 'cluster_ms', 'least_loaded_cluster_ms',
                  'measured_cross_process_bytes_per_step'):
        b[key.replace('_per_step', '') + '_vs_float32'] = round(
            b[key] / f[key], 4) if f[key] else None
    harness.Emit(args, list(records.values()), Markdown)
    return 0
  finally:
    for p in procs:
      try:
        os.killpg(p.pid, 9)
      except ProcessLookupError:
        pass
      p.wait(10)


if __name__ == '__main__':
  sys.exit(main())
