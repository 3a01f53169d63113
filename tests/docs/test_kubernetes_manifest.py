"""docs/kubernetes/lingvo_ext_job.yaml restarts a preempted task, and only it.

A task stopped by SIGTERM exits with --preempted_exit_code (run here through
the trainer's own preemption path, with the chief's flags); the Jobs'
podFailurePolicy answers that status, and a pod killed for a disruption,
with a new pod; the end of training (exit 0) completes a Job and bad flags
(exit 2) fail it.
"""

import os
import re
import signal
import subprocess
import sys

import lingvo.compat as tf
import pytest

from tests.support import k8s_testlib
from tests.support import proc_testlib

TIMEOUT = 300


def _Container(job):
  (container,) = job['spec']['template']['spec']['containers']
  return container


def testEveryJobRestartsAPreemptedPodAndEndsOnlyAtTheEndOfTraining():
  jobs = k8s_testlib.Jobs()
  assert sorted(jobs) == ['lx-chief', 'lx-worker']
  for name, job in jobs.items():
    pod = job['spec']['template']['spec']
    # A podFailurePolicy is refused unless failed pods are not restarted in
    # place.
    assert pod['restartPolicy'] == 'Never', name
    container = _Container(job)
    flags = k8s_testlib.Flags(container['args'])
    code = int(flags['preempted_exit_code'])
    assert code != 0, name
    assert pod['terminationGracePeriodSeconds'] > float(
        flags['shutdown_grace_secs']), name
    action = lambda *a, **k: k8s_testlib.PodFailureAction(job, *a, **k)  # pylint: disable=cell-var-from-loop
    assert action(code) == 'Ignore', name  # Preempted, saved: a new pod.
    assert action(143, conditions={'DisruptionTarget'}) == 'Ignore', name
    assert action(137, conditions={'DisruptionTarget'}) == 'Ignore', name
    assert action(2) == 'FailJob', name  # Bad flags: no retry helps.
    for counted in (1, 3, 65, 74, 143):  # Failures count toward backoffLimit.
      assert action(counted) is None, (name, counted)
    for rule in job['spec']['podFailurePolicy']['rules']:
      if 'onExitCodes' in rule:
        assert rule['onExitCodes']['containerName'] == container['name']


@pytest.mark.e2e
def testAPreemptedChiefExitsWithTheStatusItsJobRestartsAndTheRestartResumes(
    tmp_path):
  chief = k8s_testlib.Jobs()['lx-chief']
  flags = k8s_testlib.Flags(_Container(chief)['args'])
  code = int(flags['preempted_exit_code'])
  # The chief's own flags, run on this machine: its place in the cluster
  # (TF_CONFIG) aside, the worker_split_size cells on local devices.
  local = [f'--{k}={v}' for k, v in flags.items()
           if k not in ('cluster_resolver', 'logdir', 'max_steps')]
  logdir = str(tmp_path / 'lm')
  argv = [sys.executable, '-m', 'lingvo_ext.trainer', *local,
          f'--logdir={logdir}',
          f'--num_cpu_devices={flags["worker_split_size"]}']
  with proc_testlib.Proc([*argv, '--max_steps=1000000']) as run:
    run.WaitFor(r'^step (\d*[1-9]\d)/', TIMEOUT)  # Step 10 or more.
    run.proc.send_signal(signal.SIGTERM)
    rc = run.Wait()
  out = run.Text()
  assert rc == code, out[-3000:]
  assert 'SIGTERM: stopping safely' in out, out[-3000:]
  assert k8s_testlib.PodFailureAction(chief, rc) == 'Ignore'
  train_dir = os.path.join(logdir, 'train')
  step = int(tf.train.latest_checkpoint(train_dir).rsplit('-', 1)[1])
  assert step >= 10
  # The Job's new pod runs the same command; it ends training with 0, which
  # completes the Job.
  with proc_testlib.Proc([*argv, f'--max_steps={step + 2}']) as rerun:
    rc = rerun.Wait()
  assert rc == 0, rerun.Text()[-3000:]
  assert tf.train.latest_checkpoint(train_dir).endswith(f'-{step + 2:08d}')
  assert not re.search(rf'^step {step}/', rerun.Text(), re.M)


@pytest.mark.e2e
@pytest.mark.parametrize('program', [['lingvo_ext.trainer'],
                                     ['lingvo_ext.launch', '--workers=1']])
def testABadPreemptedExitCodeIsOneLineAndExit2(tmp_path, program):
  logdir = tmp_path / 'log'
  proc = subprocess.run(
      [sys.executable, '-m', *program, '--model=lm.TransformerLmTiny',
       f'--logdir={logdir}', '--preempted_exit_code=143'],
      cwd=proc_testlib.ROOT, capture_output=True, text=True, timeout=TIMEOUT)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert errors == [
      'error: --preempted_exit_code=143 must be 0-255 and none of 1, 2, 3, '
      '65, 74, 130, 137, 143 (codes with their own meaning), e.g. 75.'
  ], proc.stderr
  assert 'Traceback' not in proc.stderr
  assert not logdir.exists()
