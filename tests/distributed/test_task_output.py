"""task_output: what the launcher shows of its tasks' logs."""

import io

from lingvo_ext.distributed import cluster_tasks
from lingvo_ext.distributed import task_output


def _Task(tmp_path):
  t = cluster_tasks.Task('worker', 1, '127.0.0.1:1', ['true'])
  t.log_path = str(tmp_path / 'worker.1.log')
  return t


def _Append(task, data):
  with open(task.log_path, 'ab') as f:
    f.write(data)


def testShowsNewLinesOnceAndHoldsAPartialLine(tmp_path):
  out = io.StringIO()
  output = task_output.Output(out, str(tmp_path))
  task = _Task(tmp_path)
  task_output.ShowNewLines(task, output, False)  # No log yet: nothing.
  _Append(task, b'I1128 INFO a log record\nstep 3/10 loss 2.5\nerror: bad')
  task_output.ShowNewLines(task, output, False)
  output.Flush()
  assert out.getvalue() == '[worker1] step 3/10 loss 2.5\n'
  _Append(task, b' flag\nworker task 0: lost contact\n')
  task_output.ShowNewLines(task, output, False)
  task_output.ShowNewLines(task, output, False)  # Nothing new.
  output.Flush()
  assert out.getvalue().splitlines()[1:] == [
      '[worker1] error: bad flag', '[worker1] worker task 0: lost contact']


def testStreamLogsShowsEveryLine(tmp_path):
  out = io.StringIO()
  output = task_output.Output(out, str(tmp_path))
  task = _Task(tmp_path)
  _Append(task, b'I1128 INFO a log record\nstep 3/10\n')
  task_output.ShowNewLines(task, output, True)
  output.Flush()
  assert out.getvalue().splitlines() == ['[worker1] I1128 INFO a log record',
                                         '[worker1] step 3/10']


def testLastLinesAreTheLogsEndIndented(tmp_path):
  task = _Task(tmp_path)
  assert task_output.LastLines(task.log_path) == ''  # No log.
  _Append(task, b''.join(b'line %d\n' % i for i in range(20)))
  assert task_output.LastLines(task.log_path, 2) == '  | line 18\n  | line 19\n'

