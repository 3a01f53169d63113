"""The memory check against what the machine (or cgroup) has: --plan=auto's
warning and the built graph's variables (preflight/memory_check.py)."""

import types

import lingvo.compat as tf

from lingvo_ext.preflight import memory_check


def testMemoryWarningNamesTheNeedTheLimitAndAPlanThatFits():
  available, source = memory_check.AvailableBytes()
  assert available and available > 0 and source
  chosen = types.SimpleNamespace(process_bytes=3 << 30)
  budgets = []

  def Replan(budget):
    budgets.append(budget)
    return ('task.num_micro_batches:8; task.recompute:True',
            dict(num_cpu_devices=2, worker_split_size=2))

  # Enough memory: no line, no replanning.
  assert memory_check.CheckAutoPlan(chosen, 2, Replan, 4 << 30, 'x') is None
  assert not budgets
  line = memory_check.CheckAutoPlan(chosen, 2, Replan, 1 << 30,
                                    "the cgroup's memory limit")
  assert budgets == [1 << 29]  # Per device.
  assert line == (
      'warning: the plan needs about 3.0 GB (1.5 GB per device, 2 device(s)) '
      "but the cgroup's memory limit is 1.0 GB: it may be killed by the OOM "
      'killer; a plan that fits: --num_cpu_devices=2 --worker_split_size=2 '
      "--model_params_override='task.num_micro_batches:8; "
      "task.recompute:True'."), line

  def NoneFits(budget):
    raise ValueError(f'--memory_per_device={budget} fits no plan')

  line = memory_check.CheckAutoPlan([('lm', chosen)], 2, NoneFits, 1 << 30,
                                    'x')
  assert line.endswith('no plan fits; use more memory, more devices '
                       '(--devices) or bf16 (task.fprop_dtype).'), line


def testVariablesWarningCountsTheBuiltGraphsVariables():
  with tf.Graph().as_default() as graph:
    tf.Variable(tf.zeros([1000, 250]), name='w')  # 1 MB of float32.
    tf.Variable(tf.zeros([10], tf.int64), name='n')
  size = memory_check.GraphVariableBytes(graph)
  assert size == 1000 * 250 * 4 + 80
  assert memory_check.VariablesWarning(size, 2 << 20, 'x') is None
  line = memory_check.VariablesWarning(size, 512 << 10,
                                       "the cgroup's memory limit")
  assert line.startswith("warning: the model's variables and optimizer slots "
                         "alone take 977 KB, more than the cgroup's memory "
                         'limit (512 KB): '), line
