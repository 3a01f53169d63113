"""Pipelines that come cut (tree.py)."""

import pytest

from lingvo_ext import planner
from tests.support import planner_testlib as lib


def test_tree_plans_keep_the_cells_and_share_the_devices():
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  lm = tree.TreePipeline(path='task.lm.stack', cls_name='Stack',
                         profile=lib.Profile(num_layers=2, batch=8,
                                             linear_loss=False))
  other = tree.TreePipeline(path='task.enc.stack', cls_name='PipeliningLayer',
                            profile=lib.Profile(num_layers=4, batch=8,
                                                linear_loss=False),
                            micro_batch_size=2)
  ranked = tree.ChooseTree([lm, other], devices=4)
  assert [pipe.path for pipe, _ in ranked] == ['task.lm.stack',
                                               'task.enc.stack']
  for pipe, plans in ranked:
    k = len(pipe.profile.layers)
    assert plans and all(p.num_cells == k and p.replicas == 1 for p in plans)
    assert all(8 % p.num_micro_batches == 0 for p in plans)
  # The second pipeline runs on the first one's devices.
  assert (ranked[1][1][0].devices_per_replica ==
          ranked[0][1][0].devices_per_replica)
  chosen = [(pipe, plans[0]) for pipe, plans in ranked]
  overrides = tree.TreeOverrides(*chosen[1])
  best = chosen[1][1]
  assert overrides['task.enc.stack.num_micro_batches'] == (
      best.num_micro_batches)
  assert overrides['task.enc.stack.schedule'] == best.schedule
  # A micro_batch_size the new count would contradict is reset.
  assert overrides['task.enc.stack.micro_batch_size'] is None
  assert 'task.lm.stack.micro_batch_size' not in tree.TreeOverrides(
      *chosen[0])
  text = tree.TreeOverrideString(chosen)
  assert text.count(';') == 6 and 'task.enc.stack.micro_batch_size:None' in text
  assert 'task.lm.stack.schedule:"%s"' % chosen[0][1].schedule in text
  # Within a budget too small for any plan: the least that would fit.
  with pytest.raises(planner.PlanError) as e:
    tree.ChooseTree([lm], devices=2, memory_per_device=1)
  assert '--memory_per_device' in str(e.value)
