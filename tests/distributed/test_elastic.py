"""elastic.py: when a worker is lost for good and what the launcher does then
(no processes, no TensorFlow)."""

from lingvo_ext.distributed import elastic


def testADeathIsALossOnlyOnceTheRestartsAreUsed():
  assert elastic.LostForGood('worker', 1, 'signal SIGKILL', 0, 1) is None
  loss = elastic.LostForGood('worker', 1, 'signal SIGKILL', 1, 1)
  assert loss == elastic.Loss(
      'worker', 1, 'signal SIGKILL after 1 restart(s) in all, '
      '--max_restarts=1')
  assert loss.what == 'worker task 1'
  # --max_restarts=0: the first death is for good.
  assert elastic.LostForGood('worker', 0, 'exit code 1', 0, 0) is not None


def testARestartedTaskNotBackWithinTheBoundIsLost():
  args = ('worker', 1)
  assert elastic.NotBack(*args, restarted=False, ready=False, waited_s=500,
                         ready_timeout_s=120) is None  # A first start.
  assert elastic.NotBack(*args, restarted=True, ready=True, waited_s=500,
                         ready_timeout_s=120) is None
  assert elastic.NotBack(*args, restarted=True, ready=False, waited_s=120,
                         ready_timeout_s=120) is None
  loss = elastic.NotBack(*args, restarted=True, ready=False, waited_s=121.4,
                         ready_timeout_s=120)
  assert loss.why == ('not back 121 s after its restart, '
                      '--ready_timeout_secs=120')


def testDecideReplansOntoTheWorkersLeftKeepingTheReplicaCount():
  loss = elastic.Loss('worker', 1, 'x')
  d = elastic.Decide(loss, num_workers=2, devices_per_worker=1, split_size=2,
                     elastic=True)
  assert d == elastic.Decision(elastic.REPLAN, workers_left=1, devices_left=1,
                               replicas=1)
  # 2 replicas x 2 cells on 4 workers of 2 devices each.
  d = elastic.Decide(loss, 4, 2, 2, True)
  assert (d.workers_left, d.devices_left, d.replicas) == (3, 6, 4)


def testDecideStops():
  worker = elastic.Loss('worker', 0, 'x')
  assert elastic.Decide(worker, 2, 1, 2, elastic=False) == elastic.Decision(
      elastic.STOP, why='--elastic=false')
  d = elastic.Decide(elastic.Loss('ps', 0, 'x'), 2, 1, 2, True)
  assert d.action == elastic.STOP and 'the ps, not a worker' in d.why
  d = elastic.Decide(worker, 1, 1, 1, True)
  assert d.action == elastic.STOP and 'no worker is left' in d.why


def testNewLayoutMakesWholeWorkersAndNodes():
  assert elastic.NewLayout(2, 2, 1) == ((2, 2), '')
  assert elastic.NewLayout(4, 2, 2) == ((2, 2), '')
  assert elastic.NewLayout(1, 1, 1) == ((1, 1), '')
  layout, why = elastic.NewLayout(3, 3, 2)
  assert layout is None and '--num_cpu_devices=2' in why
  layout, why = elastic.NewLayout(3, 3, 1, nodes=2)
  assert layout is None and '--nodes=2' in why


def testReplannedFlagsReplaceThePlansFlagsOnly():
  flags = ['--model=lm.X', '--logdir=/l', '--worker_split_size=2',
           "--model_params_override=train.save_interval_seconds:1",
           '--max_steps=9', '--num_cpu_devices=1']
  got = elastic.ReplannedFlags(
      flags, 'train.save_interval_seconds:1; task.num_partitions:1', 1, 1)
  assert got == ['--model=lm.X', '--logdir=/l', '--max_steps=9',
                 '--model_params_override=train.save_interval_seconds:1; '
                 'task.num_partitions:1',
                 '--num_cpu_devices=1', '--worker_split_size=1']


def testTheLines():
  loss = elastic.Loss('worker', 1, 'signal SIGKILL after 1 restart(s) in all, '
                      '--max_restarts=1')
  assert elastic.LossLine(loss, 1, 2, 1, 4, 'ckpt-00000700') == (
      'launch: worker task 1 is lost for good (signal SIGKILL after 1 '
      'restart(s) in all, --max_restarts=1): re-planned onto 1 worker (2 '
      'cells on 1 device, M 4); resuming from ckpt-00000700.')
  assert elastic.LossLine(loss, 2, 1, 2, 1, None).endswith(
      'onto 2 workers (1 cell on 2 devices, M 1); no checkpoint yet: starting '
      'from the initial weights.')
  assert elastic.RecoveredLine(712, 13.04, 1) == (
      'launch: recovered: step 712 trained 13.0 s after the loss, on 1 '
      'worker.')


def testStepOfAProgressLine():
  assert elastic.StepOf('step 12/100  loss 2.3456  3.10 steps/s') == 12
  assert elastic.StepOf('stepping') is None
  assert elastic.StepOf('controller: restored ...') is None
