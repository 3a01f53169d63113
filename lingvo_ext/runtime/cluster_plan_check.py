"""The plan check of a cluster's tasks (lingvo_ext.launch, a hand-started
cluster).

The task that trains (the trainer client, or the chief running it) measures
the steady step as a local run does (plan_check.PlanCheck); the workers hold
the cells, so theirs is the peak RSS the memory model predicts (a replica's
cells on --num_cpu_devices devices, the local trainer's estimate there).
Each worker posts its peak RSS to LOGDIR/train/plan_check/ (every
`POLL_S`); at its check the client prints its line with the fullest
worker's, and posts its step and prediction there; each worker then prints
its own line (its own peak RSS, the client's step and prediction), once.
Files older than the task's start are another run's. The launcher shows
the lines prefixed with the task's name (task_output.SHOWN). The planner's
machine is one process's devices: the transfers between tasks are not in
the prediction (docs/performance.md, "The plan check").
"""

import json
import os
import threading
import time
from typing import Dict
from typing import Optional

from lingvo_ext.runtime import plan_check

POLL_S = 1.
STEP_FILE = 'step.json'


def Dir(logdir: str) -> str:
  return os.path.join(logdir, 'train', 'plan_check')


def _WriteJson(path: str, value: Dict) -> None:
  tmp = f'{path}.{os.getpid()}.tmp'
  with open(tmp, 'w') as f:
    json.dump(value, f)
  os.replace(tmp, path)


def _ReadJson(path: str, since: float) -> Optional[Dict]:
  """The file's value if it was written after `since` (else None)."""
  try:
    if os.path.getmtime(path) < since:
      return None
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def WorkersPeakRss(directory: str, since: float) -> Optional[float]:
  """The fullest worker's posted peak RSS, bytes (None if none posted)."""
  got = []
  try:
    names = os.listdir(directory)
  except OSError:
    return None
  for name in names:
    if name.startswith('worker.') and name.endswith('.json'):
      value = _ReadJson(os.path.join(directory, name), since)
      if value and value.get('rss_bytes'):
        got.append(value['rss_bytes'])
  return max(got) if got else None


def ClientCheck(o, max_steps, stop=None) -> Optional[plan_check.PlanCheck]:
  """The training client's PlanCheck (plan_prediction.Start's), the fullest
  worker's peak RSS measured, its step and prediction posted for them."""
  from lingvo_ext.runtime import plan_prediction  # pylint: disable=g-import-not-at-top
  if not o.logdir:
    return plan_prediction.Start(o, max_steps, stop)
  directory, start = Dir(o.logdir), time.time()
  os.makedirs(directory, exist_ok=True)
  summary_dir = os.path.join(o.logdir, 'train')
  check = []

  def Rss():
    return WorkersPeakRss(directory, start) or plan_check.PeakRss()

  def Emit(lines, scalars, step):
    plan_check.Emit(lines, scalars, step, summary_dir=summary_dir)
    _WriteJson(os.path.join(directory, STEP_FILE), dict(
        step=step, step_s=scalars['plan_check/step_ms'] / 1e3,
        predicted=check[0].predicted.ToDict()))

  check.append(plan_prediction.Start(o, max_steps, stop, emit=Emit, rss=Rss))
  return check[0]


def StartWorker(o, stop: threading.Event, poll_s: float = POLL_S) -> None:
  """A worker's side, on a thread: posts its peak RSS until the client's
  step is posted, then prints its own line once."""
  if not o.logdir or o.plan_check_steps <= 0:
    return
  directory, start = Dir(o.logdir), time.time()
  mine = os.path.join(directory, f'worker.{o.task}.json')

  def Run():
    while not stop.is_set():
      rss = plan_check.PeakRss()
      if not rss:
        return  # No /proc: nothing to check against.
      os.makedirs(directory, exist_ok=True)
      _WriteJson(mine, dict(rss_bytes=rss))
      posted = _ReadJson(os.path.join(directory, STEP_FILE), start)
      if posted:
        predicted = plan_check.Predicted.FromDict(posted['predicted'])
        step_s = posted['step_s']
        plan_check.Emit([plan_check.Line(step_s, rss, predicted)] +
                        plan_check.OffLines(step_s, rss, predicted), {},
                        posted['step'])
        return
      stop.wait(poll_s)

  threading.Thread(target=Run, daemon=True, name='plan_check').start()
