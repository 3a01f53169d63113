"""cluster_tasks: each task of a local cluster is told the place it has."""

import json

import pytest

from lingvo_ext.distributed import cluster
from lingvo_ext.distributed import cluster_tasks
from lingvo_ext.distributed import resolvers


def _Flag(argv, name):
  [value] = [a.split('=', 1)[1] for a in argv if a.startswith(f'--{name}=')]
  return value


@pytest.mark.parametrize('num_ps', [0, 2])
def testFlagsTellEachTaskItsAddressInOneSpec(num_ps):
  tasks = cluster_tasks.ClusterTasks(3, ['--model=m'], 'flags', num_ps=num_ps)
  # Workers and ps first: the clients wait for them.
  assert [t.name for t in tasks] == (
      ['worker0', 'worker1', 'worker2'] + ['ps'] * num_ps +
      ['controller', 'trainer_client'])
  specs = {_Flag(t.argv, 'cluster_spec') for t in tasks}
  assert len(specs) == 1
  jobs = cluster.ParseClusterSpec(specs.pop())
  addresses = [a for job in jobs.values() for a in job]
  assert len(set(addresses)) == len(tasks)  # One port each.
  for t in tasks:
    assert (_Flag(t.argv, 'job'), int(_Flag(t.argv, 'task'))) == (t.job,
                                                                   t.task)
    assert jobs[t.job][t.task] == t.address
    assert t.address.startswith('127.0.0.1:')
    assert t.argv[-1] == '--model=m' and '--mode=sync' in t.argv


def _Resolved(resolved, task):
  """resolved's (job, task, address) in the launcher's names."""
  job = 'chief' if resolved.job == resolvers.CHIEF_JOBS else resolved.job
  lingvo_job = 'controller' if job == 'chief' else job
  return job, resolved.task, resolved.jobs[lingvo_job][task.task]


@pytest.mark.parametrize('num_ps', [0, 1])
def testTFConfigOfEachTaskResolvesToItsPlace(num_ps):
  tasks = cluster_tasks.ClusterTasks(2, [], 'tf_config', num_ps=num_ps)
  assert [t.job for t in tasks][-1] == 'chief'
  for t in tasks:
    assert json.loads(t.env['TF_CONFIG'])['task'] == {'type': t.job,
                                                      'index': t.task}
    got = resolvers.FromTFConfig(t.env)
    assert _Resolved(got, t) == (t.job, t.task, t.address)
    assert '--cluster_resolver=tf_config' in t.argv


# --workers is a multiple of --nodes (lingvo_ext.launch checks).
@pytest.mark.parametrize('workers,nodes', [(3, 1), (4, 2), (6, 3)])
def testSlurmEnvironmentOfEachTaskResolvesToItsPlace(workers, nodes):
  tasks = cluster_tasks.ClusterTasks(workers, [], 'slurm', nodes=nodes)
  assert [t.name for t in tasks] == [f'worker{i}' for i in range(workers)] + [
      'chief']
  base = int(_Flag(tasks[0].argv, 'slurm_port_base'))
  hosts = {t.address.split(':')[0] for t in tasks}
  assert hosts == {f'127.0.0.{n + 1}' for n in range(nodes)}
  for t in tasks:
    got = resolvers.FromSlurm(base, t.env)
    assert _Resolved(got, t) == (t.job, t.task, t.address)


def testAnUnknownClusterFromNamesTheChoices():
  with pytest.raises(ValueError, match=r'--cluster_from=k8s is not one of '
                     r'flags, tf_config, slurm'):
    cluster_tasks.ClusterTasks(1, [], 'k8s')
