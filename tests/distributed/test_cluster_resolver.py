"""--cluster_resolver: TF_CONFIG and Slurm mapped onto Lingvo's jobs.

Also the examples in docs/: the Kubernetes manifest and the sbatch script,
read as Kubernetes and Slurm would, must give each pod or task the cluster,
job and task the pipeline layout expects.
"""

import json
import os
import re
import stat
import subprocess
import sys

import pytest

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import resolvers
from tests.support import ROOT
from tests.support import k8s_testlib
from tests.support import proc_testlib
from tests.support import zygote

MODEL = 'lm.TransformerLmTinyGPipe'


def _Config(spec, task_type, index):
  return {'TF_CONFIG': resolvers.TFConfig(spec, task_type, index)}


@pytest.mark.parametrize('replicas,cells,num_ps', [
    (r, k, p) for r in (1, 2, 3) for k in (1, 2, 4) for p in (0, 2)])
def testTFConfigMapsChiefWorkersAndPs(replicas, cells, num_ps):
  n = replicas * cells
  spec = {'chief': ['head:2222'],
          'worker': [f'w{i}.svc:{2300 + i}' for i in range(n)]}
  if num_ps:
    spec['ps'] = [f'ps{i}:2222' for i in range(num_ps)]
  want_jobs = {'controller': ['head:2222'], 'worker': spec['worker']}
  if num_ps:
    want_jobs['ps'] = spec['ps']
  layout = cluster.MakeWorkerLayout(n, 1, cells)
  assert layout.num_replicas == replicas
  for task_type, tasks in spec.items():
    for i in range(len(tasks)):
      got = resolvers.FromTFConfig(_Config(spec, task_type, i))
      assert got.jobs == want_jobs
      assert got.job == {'chief': 'controller,trainer_client'}.get(
          task_type, task_type)
      assert got.task == i
      # The flags round-trip through --cluster_spec's parser.
      flags = dict(f[2:].split('=', 1) for f in got.Flags())
      assert cluster.ParseClusterSpec(flags['cluster_spec']) == want_jobs
      assert (flags['job'], int(flags['task'])) == (got.job, i)
  # Cell c of replica r runs on TF_CONFIG's worker r*K+c.
  for r in range(replicas):
    for c in range(cells):
      assert want_jobs['worker'][layout.Task(r, c)] == spec['worker'][
          r * cells + c]


@pytest.mark.parametrize('env,message', [
    ({}, r'^TF_CONFIG is not set; --cluster_resolver=tf_config needs it to '
     r'hold JSON like'),
    ({'TF_CONFIG': '{"cluster": '}, r'^TF_CONFIG is not valid JSON'),
    ({'TF_CONFIG': '[1]'}, r'^TF_CONFIG must be a JSON object with "cluster" '
     r'and "task"'),
    (_Config({'worker': ['a:1']}, 'worker', 0),
     r'^TF_CONFIG\'s cluster must list exactly one "chief" task .* it lists '
     r'0\.$'),
    (_Config({'chief': ['a:1', 'b:1'], 'worker': ['a:2']}, 'worker', 0),
     r'exactly one "chief" task .* it lists 2\.$'),
    (_Config({'chief': ['a:1']}, 'chief', 0),
     r'^TF_CONFIG\'s cluster lists no "worker" task'),
    (_Config({'chief': ['a:1'], 'worker': ['a:2'], 'evaluator': ['a:3']},
             'worker', 0), r'has job\(s\) evaluator, which lingvo_ext does '
     r'not map'),
    (_Config({'chief': ['a:1'], 'worker': ['a:2']}, 'ps', 0),
     r'^TF_CONFIG\'s task type is \'ps\'; it must be one of the cluster\'s '
     r'jobs \(chief, worker\)'),
    (_Config({'chief': ['a:1'], 'worker': ['a:2', 'b:2']}, 'worker', 2),
     r'^TF_CONFIG\'s task index is 2 but its cluster lists 2 \'worker\' '
     r'task\(s\); use 0\.\.1\.$'),
    (_Config({'chief': ['a:1'], 'worker': ['a:1']}, 'worker', 0),
     r'controller task 0 and worker task 0 both use a:1'),
    (_Config({'chief': ['a'], 'worker': ['a:1']}, 'worker', 0),
     r"bad address 'a' in job 'controller'; write host:port"),
])
def testTFConfigErrorsNameTheVariableAndWhatItMustHold(env, message):
  with pytest.raises(resolvers.ResolveError) as e:
    resolvers.FromTFConfig(env)
  assert re.search(message, str(e.value)), str(e.value)
  assert '\n' not in str(e.value)


def _BlockLayout(num_tasks, num_nodes):
  """Tasks per node as Slurm's block distribution spreads them."""
  return [num_tasks // num_nodes + (n < num_tasks % num_nodes)
          for n in range(num_nodes)]


@pytest.mark.parametrize('per_node', [
    [2], [3, 2], [2, 2, 1], [1, 1, 1, 1, 1], [5, 4], [3, 3, 3]])
def testSlurmRanksMapInNodeOrder(per_node):
  hosts = [f'node{n + 1:02d}' for n in range(len(per_node))]
  base = 9100
  n = sum(per_node)
  node_of_rank = [h for h, k in zip(hosts, per_node) for _ in range(k)]
  want = {'controller': [f'{node_of_rank[0]}:{base}'],
          'worker': [f'{node_of_rank[r]}:{base + r}' for r in range(1, n)]}
  for rank in range(n):
    env = resolvers.SlurmEnv(hosts, per_node, rank)
    assert env['SLURMD_NODENAME'] == node_of_rank[rank]
    got = resolvers.FromSlurm(base, env)
    assert got.jobs == want, (rank, got.jobs)
    if rank == 0:
      assert (got.job, got.task) == ('controller,trainer_client', 0)
    else:
      assert (got.job, got.task) == ('worker', rank - 1)


@pytest.mark.parametrize('change,message', [
    ({'SLURM_PROCID': None}, r'^SLURM_PROCID is not set; '
     r'--cluster_resolver=slurm needs the environment of a task started by '
     r'srun \(SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST, '
     r'SLURM_STEP_TASKS_PER_NODE\)'),
    ({'SLURM_STEP_NODELIST': None}, r'^SLURM_STEP_NODELIST is not set'),
    ({'SLURM_PROCID': 'x'}, r"^SLURM_PROCID='x' must be a number"),
    ({'SLURM_PROCID': '5'}, r'^SLURM_PROCID=5 must be below '
     r'SLURM_STEP_NUM_TASKS=5'),
    ({'SLURM_STEP_NUM_TASKS': '1', 'SLURM_STEP_TASKS_PER_NODE': '1',
      'SLURM_STEP_NODELIST': 'n1'}, r'^SLURM_STEP_NUM_TASKS=1: the step '
     r'needs 1 \+ R\*K tasks'),
    ({'SLURM_STEP_TASKS_PER_NODE': '2(x2)'}, r"^SLURM_STEP_TASKS_PER_NODE="
     r"'2\(x2\)' must give one count per node of SLURM_STEP_NODELIST \(2 "
     r'node\(s\)\) adding up to SLURM_STEP_NUM_TASKS=5'),
    ({'SLURM_STEP_TASKS_PER_NODE': '3,x'}, r'^SLURM_STEP_TASKS_PER_NODE: '
     r'Invalid tasks-per-node list format'),
    ({'SLURM_STEP_NODELIST': 'n[1-'}, r'^SLURM_STEP_NODELIST: Invalid '
     r'hostlist format'),
])
def testSlurmErrorsNameTheVariableAndWhatItMustHold(change, message):
  env = resolvers.SlurmEnv(['n1', 'n2'], [3, 2], 1)
  for k, v in change.items():
    if v is None:
      del env[k]
    else:
      env[k] = v
  with pytest.raises(resolvers.ResolveError) as e:
    resolvers.FromSlurm(8888, env)
  assert re.search(message, str(e.value)), str(e.value)
  assert '\n' not in str(e.value)


def testKubernetesManifestGivesEachPodItsTask():
  docs = k8s_testlib.Documents()
  by_kind = {}
  for d in docs:
    by_kind.setdefault(d['kind'], []).append(d)
  (service,) = by_kind['Service']
  (policy,) = by_kind['NetworkPolicy']
  jobs = {j['metadata']['name']: j for j in by_kind['Job']}
  assert service['spec']['clusterIP'] == 'None'  # Headless: pod DNS names.
  label = service['spec']['selector']
  pods = {}  # DNS name -> (TF_CONFIG task, command, env)
  for name, job in jobs.items():
    spec = job['spec']
    assert spec['completionMode'] == 'Indexed'
    template = spec['template']
    assert template['metadata']['labels'] == label
    assert template['spec']['subdomain'] == service['metadata']['name']
    (container,) = template['spec']['containers']
    ports = [p['containerPort'] for p in container['ports']]
    for index in range(spec['completions']):
      # An Indexed Job's pod is named JOB-INDEX; with the Service as its
      # subdomain it resolves as JOB-INDEX.SERVICE.
      dns = f'{name}-{index}.{service["metadata"]["name"]}'
      env = k8s_testlib.PodEnv(container, index, name)
      resolved = resolvers.FromTFConfig(env)
      pods[dns] = (resolved, container['command'] + container['args'], ports)
  # Same command and flags everywhere; only TF_CONFIG differs.
  commands = {tuple(c) for _, c, _ in pods.values()}
  assert len(commands) == 1, commands
  command = list(commands.pop())
  assert command[:3] == ['python', '-m', 'lingvo_ext.trainer']
  flags = k8s_testlib.Flags(command[3:])
  assert flags['cluster_resolver'] == 'tf_config'
  assert not {'cluster_spec', 'job', 'task'} & set(flags)
  # Every pod resolves the same cluster, whose addresses are the pods.
  clusters = {r.cluster_spec for r, _, _ in pods.values()}
  assert len(clusters) == 1, clusters
  jobs_spec = cluster.ParseClusterSpec(clusters.pop())
  for dns, (resolved, _, ports) in pods.items():
    job = resolved.job.split(',')[0]
    assert jobs_spec[job][resolved.task] == f'{dns}:{ports[0]}', dns
  roles = sorted((r.job, r.task) for r, _, _ in pods.values())
  assert roles == [('controller,trainer_client', 0)] + [
      ('worker', i) for i in range(4)], roles
  # 2 replicas x 2 cells: replica r's cell c on pod lx-worker-(r*2+c).
  split = int(flags['worker_split_size'])
  layout = cluster.MakeWorkerLayout(len(jobs_spec['worker']), 1, split)
  assert (layout.num_replicas, split) == (2, 2)
  for r in range(2):
    for c in range(2):
      assert jobs_spec['worker'][layout.Task(r, c)].startswith(
          f'lx-worker-{r * 2 + c}.')
  # The NetworkPolicy admits only this job's pods, only on the gRPC port.
  spec = policy['spec']
  assert spec['podSelector']['matchLabels'] == label
  assert spec['policyTypes'] == ['Ingress']
  (rule,) = spec['ingress']
  assert rule['from'] == [{'podSelector': {'matchLabels': label}}]
  all_ports = {cluster.Port(a) for a in sum(jobs_spec.values(), [])}
  assert {p['port'] for p in rule['ports']} == all_ports == {2222}


def testSbatchScriptGivesEachTaskItsTask(tmp_path):
  path = os.path.join(ROOT, 'docs', 'slurm', 'lingvo_ext.sbatch')
  with open(path) as f:
    text = f.read()
  sbatch = dict(re.findall(r'^#SBATCH --([\w-]+)=(\S+)', text, re.M))
  nodes, ntasks = int(sbatch['nodes']), int(sbatch['ntasks'])
  assert sbatch['distribution'] == 'block'
  # Run the script as sbatch would, with an srun that records its command.
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  record = tmp_path / 'srun.json'
  srun = bin_dir / 'srun'
  srun.write_text(f'#!{sys.executable}\nimport json, sys\n'
                  f'json.dump(sys.argv[1:], open({str(record)!r}, "w"))\n')
  srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
  hosts = [f'node{n + 1}' for n in range(nodes)]
  env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}',
             HOME=str(tmp_path), SLURM_JOB_NUM_NODES=str(nodes),
             SLURM_NTASKS=str(ntasks), SLURM_JOB_NODELIST='node[1-2]')
  env.pop('LOGDIR', None)
  subprocess.run(['bash', path], env=env, check=True, timeout=30)
  argv = json.loads(record.read_text())
  i = argv.index('python')
  assert argv[i:i + 3] == ['python', '-m', 'lingvo_ext.trainer']
  assert all(a.startswith('--') for a in argv[:i]), argv[:i]
  flags = k8s_testlib.Flags(argv[i + 3:])
  assert flags['cluster_resolver'] == 'slurm'
  assert flags['logdir'] == f'{tmp_path}/lingvo_ext/lm_slurm'
  assert not {'cluster_spec', 'job', 'task'} & set(flags)
  base = int(flags.get('slurm_port_base', 8888))
  split = int(flags['worker_split_size'])
  per_node = _BlockLayout(ntasks, nodes)
  assert per_node == [3, 2]
  tasks = [resolvers.FromSlurm(base, resolvers.SlurmEnv(hosts, per_node, r))
           for r in range(ntasks)]
  assert len({t.cluster_spec for t in tasks}) == 1
  jobs = tasks[0].jobs
  assert [(t.job, t.task) for t in tasks] == [
      ('controller,trainer_client', 0)] + [('worker', i) for i in range(4)]
  assert jobs == {'controller': ['node1:8888'],
                  'worker': ['node1:8889', 'node1:8890', 'node2:8891',
                             'node2:8892']}
  # 2 replicas x 2 cells; each replica's cells share a node.
  layout = cluster.MakeWorkerLayout(len(jobs['worker']), 1, split)
  assert layout.num_replicas == 2
  for r, node in enumerate(hosts):
    assert {cluster.Host(jobs['worker'][layout.Task(r, c)])
            for c in range(split)} == {node}
  assert '8888-8892' in text  # The ports the comment tells users to guard.


def _Trainer(*flags, env=None, timeout=120):
  """The trainer in a network namespace of its own (only 127.0.0.1),
  forked (tests/support/zygote.py): exit code, output. A run that outlasts
  `timeout` fails the test (subprocess.TimeoutExpired)."""
  full_env = {k: v for k, v in os.environ.items()
              if k != 'TF_CONFIG' and not k.startswith('SLURM')}
  full_env.update(env or {})
  proc = zygote.run(
      [sys.executable, '-c', proc_testlib.PRIVATE_TRAINER, f'--model={MODEL}',
       '--logdir=/tmp/unused_lingvo_ext', *flags], cwd=ROOT, env=full_env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=timeout, check=False)
  return proc.returncode, proc.stdout


@pytest.mark.e2e
def testTrainerRejectsAMissingOrConflictingEnvironment():
  rc, out = _Trainer('--cluster_resolver=tf_config')
  assert rc == 2, out[-2000:]
  assert re.search(r'^error: TF_CONFIG is not set; --cluster_resolver='
                   r'tf_config needs it to hold JSON like', out, re.M), out
  rc, out = _Trainer('--cluster_resolver=tf_config',
                        '--cluster_spec=worker=127.0.0.1:2222',
                        env=_Config({'chief': ['127.0.0.1:2221'],
                                     'worker': ['127.0.0.1:2222']},
                                    'worker', 0))
  assert rc == 2, out[-2000:]
  assert ('error: --cluster_resolver=tf_config sets --cluster_spec, --job and '
          '--task from the environment; drop --cluster_spec.') in out


@pytest.mark.e2e
def testAWorkerWhoseChiefNeverAnswersExitsOnItsOwn():
  from lingvo_ext.distributed import network  # pylint: disable=g-import-not-at-top
  chief, worker = network.FreePorts(2)
  spec = {'chief': [f'127.0.0.1:{chief}'], 'worker': [f'127.0.0.1:{worker}']}
  # Its wait for the chief's word outlasts --worker_timeout_secs (the
  # deadline of each of its session calls); it ends within _Trainer's
  # timeout, not at it.
  rc, out = _Trainer('--cluster_resolver=tf_config',
                           '--cluster_wait_secs=5', '--worker_timeout_secs=1',
                           env=_Config(spec, 'worker', 0))
  assert rc == 1, out[-2000:]
  assert re.search(
      r'^error: worker task 0: controller task 0 \(127\.0\.0\.1:%d\) has not '
      r'answered for \d+ s \(--cluster_wait_secs=5\); the cluster is gone: '
      r'exiting\.' % chief, out, re.M), out[-2000:]
  assert 'Traceback' not in out, out[-2000:]


def testEachTaskWatchesThePeersItNeeds():
  """Servers watch the clients; clients the servers and the other client."""
  from lingvo_ext.distributed import server  # pylint: disable=g-import-not-at-top
  jobs = {'controller': ['h:1'], 'trainer_client': ['h:2'],
          'worker': ['w:1', 'w:2'], 'ps': ['p:1']}
  servers = {'worker task 0', 'worker task 1', 'ps task 0'}
  cases = [
      (['worker'], 1, {'controller task 0', 'trainer_client task 0'}),
      (['ps'], 0, {'controller task 0', 'trainer_client task 0'}),
      (['controller'], 0, servers | {'trainer_client task 0'}),
      (['trainer_client'], 0, servers | {'controller task 0'}),
      # A chief runs both clients: it watches only the servers.
      (['controller', 'trainer_client'], 0, servers),
  ]
  for process_jobs, task, want in cases:
    watch = server.ClusterWatch(jobs, process_jobs, task, wait_s=1)
    assert set(watch._peers) == want, process_jobs  # pylint: disable=protected-access
