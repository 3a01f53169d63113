"""runtime/progress.py: the rate and ETA of the recent steps (a fake clock)."""

import io

from lingvo_ext.runtime import progress


def _Steps(p, now, first, last, every_s):
  for step in range(first, last + 1):
    now[0] += every_s
    p.Update(step, 2.0, 8)


def testAfterAStallTheRateAndEtaAreTheRecentSteps():
  now = [1000.0]
  out = io.StringIO()
  p = progress.Progress(1000, stream=out, clock=lambda: now[0])
  p.Update(1, 4.0, 8)
  _Steps(p, now, 2, 100, 1.0)  # 1 step/s.
  now[0] += 57.0  # The input stalls.
  p.Update(101, 2.0, 8)
  _Steps(p, now, 102, 110, 0.5)  # Then 2 steps/s.
  lines = out.getvalue().splitlines()
  assert lines[0] == 'step 1/1000  loss 4.0000  (measuring speed)'
  assert ('step 99/1000  loss 2.0000  1.00 steps/s  8.0 examples/s  '
          'ETA 15m01s') in lines
  stall = [l for l in lines if l.startswith('step 101/')]
  # The rate before the stall, not 1 step in 57 s (an ETA of 15 hours).
  assert stall == ['step 101/1000  loss 2.0000  1.00 steps/s  8.0 examples/s  '
                   'ETA 14m59s  (after a 57s pause)'], lines[-6:]
  after = lines[lines.index(stall[0]) + 1:]
  # The next line: the steps since the stall, and the pause named once.
  assert after[0] == ('step 105/1000  loss 2.0000  2.00 steps/s  16.0 '
                      'examples/s  ETA 7m28s'), after
  assert all('pause' not in l for l in after), after
  assert after[-1] == ('step 109/1000  loss 2.0000  2.00 steps/s  16.0 '
                       'examples/s  ETA 7m26s'), after


def testSlowStepsAreNoPause():
  now = [0.0]
  p = progress.Progress(100, clock=lambda: now[0])
  p.Line(1, 1.0, 4)
  for step in range(2, 6):
    now[0] += 20.0  # Each step 20 s: its pace, not a stall.
    line = p.Line(step, 1.0, 4)
  assert line == ('step 5/100  loss 1.0000  0.05 steps/s  0.2 examples/s  '
                  'ETA 31m40s')


def testAPauseBeforeAnyRateSaysSo():
  now = [0.0]
  p = progress.Progress(10, clock=lambda: now[0])
  p.Line(1, 1.0, 4)
  now[0] += 1.0
  p.Line(2, 1.0, 4)
  now[0] += 60.0
  assert p.Line(3, 1.0, 4) == ('step 3/10  loss 1.0000  1.00 steps/s  4.0 '
                               'examples/s  ETA 7s  (after a 1m00s pause)')


def testARestartKeepsAWaitOutOfTheRate():
  # The trainer waits at its first step for the plan check's prediction.
  now = [1000.0]
  out = io.StringIO()
  p = progress.Progress(1000, stream=out, clock=lambda: now[0], interval_s=0)
  p.Update(1, 4.0, 8)
  now[0] += 12.0  # The wait.
  p.Restart()
  _Steps(p, now, 2, 4, 0.5)  # 2 steps/s.
  lines = out.getvalue().splitlines()
  assert lines[:2] == ['step 1/1000  loss 4.0000  (measuring speed)',
                       'step 2/1000  loss 2.0000  (measuring speed)'], lines
  assert lines[2] == ('step 3/1000  loss 2.0000  2.00 steps/s  16.0 '
                      'examples/s  ETA 8m18s'), lines
