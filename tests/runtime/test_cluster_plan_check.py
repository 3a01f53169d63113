"""A cluster's plan check: the client's step, the workers' peak RSS (no
time asserted)."""

import json
import os
import threading
import time
import types

from lingvo_ext.runtime import cluster_plan_check
from lingvo_ext.runtime import plan_check

MB = 2.**20
PREDICTED = plan_check.Predicted(step_s=0.0395, rss_bytes=1050 * MB)


def _Options(logdir, task=0):
  return types.SimpleNamespace(logdir=str(logdir), task=task,
                               plan_check_steps=10)


def testTheFullestWorkersPeakRssOfThisRunIsTheClients(tmp_path):
  d = str(tmp_path)
  for task, mb in ((0, 900), (1, 1200), (2, 5000)):
    with open(os.path.join(d, f'worker.{task}.json'), 'w') as f:
      json.dump(dict(rss_bytes=mb * MB), f)
  old = time.time() - 3600
  os.utime(os.path.join(d, 'worker.2.json'), (old, old))  # Another run's.
  assert cluster_plan_check.WorkersPeakRss(d, time.time() - 60) == 1200 * MB
  assert cluster_plan_check.WorkersPeakRss(str(tmp_path / 'none'), 0) is None


def testAWorkerPostsItsPeakAndPrintsItsLineOnceTheStepIsPosted(
    tmp_path, capsys):
  stop = threading.Event()
  o = _Options(tmp_path, task=1)
  cluster_plan_check.StartWorker(o, stop, poll_s=0.05)
  d = cluster_plan_check.Dir(o.logdir)
  mine = os.path.join(d, 'worker.1.json')
  for _ in range(600):
    if os.path.exists(mine):
      break
    time.sleep(0.05)
  with open(mine) as f:
    assert 0 < json.load(f)['rss_bytes'] <= plan_check.PeakRss()
  cluster_plan_check._WriteJson(  # pylint: disable=protected-access
      os.path.join(d, cluster_plan_check.STEP_FILE),
      dict(step=12, step_s=0.0412, predicted=PREDICTED.ToDict()))
  for _ in range(600):
    out = capsys.readouterr().out
    if out:
      break
    time.sleep(0.05)
  time.sleep(0.3)  # It prints once: nothing follows.
  out += capsys.readouterr().out
  stop.set()
  lines = [l for l in out.splitlines() if l.startswith('plan check: step')]
  assert len(lines) == 1, out
  assert lines[0].startswith(
      'plan check: step 41.2 ms, predicted 39.5 ms (-4%); peak memory ')


def testTheLauncherShowsTheLine():
  from lingvo_ext.distributed import task_output  # pylint: disable=g-import-not-at-top
  assert task_output.SHOWN.match('plan check: step 41.2 ms, predicted ...')
