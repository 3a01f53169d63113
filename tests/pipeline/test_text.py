"""Action lists as text (pipeline/text.py), and each generator's lists
golden-tested from text (tests/pipeline/testdata/).

After a deliberate change of a schedule, rewrite the golden files and review
their diff:

  LINGVO_EXT_REGOLDEN=1 .venv/bin/python -m pytest tests/pipeline/test_text.py
"""

import os
import random
import re

import pytest

from lingvo_ext.pipeline import records
from lingvo_ext.pipeline import schedules

_GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'testdata')
# (K, devices, M) of each golden file, where the schedule takes them.
_CONFIGS = ((2, 2, 4), (4, 2, 4), (4, 2, 2))
_NAME = re.compile(r'^(\w+)_K(\d+)_D(\d+)_M(\d+)(_recompute)?\.txt$')


def _Spec(name, k, d, m, recompute):
  return schedules.StageSpec(k, d, m, recompute=recompute)


def _Lists(name, k, d, m, recompute):
  return records.Build(name, _Spec(name, k, d, m, recompute))


def _Cases():
  """Every (schedule, K, D, M, recompute) the generators take here."""
  out = []
  for name in sorted(records.ACTION_SCHEDULES):
    for k, d, m in _CONFIGS:
      for recompute in (False, True):
        try:
          _Lists(name, k, d, m, recompute)
        except ValueError:
          continue
        out.append((name, k, d, m, recompute))
  return out


def _File(name, k, d, m, recompute):
  return os.path.join(_GOLDEN, '%s_K%d_D%d_M%d%s.txt' % (
      name, k, d, m, '_recompute' if recompute else ''))


@pytest.mark.parametrize('case', _Cases(), ids=lambda c: os.path.basename(
    _File(*c))[:-4])
def test_generators_match_their_golden_text(case):
  text = schedules.FormatLists(_Lists(*case)) + '\n'
  path = _File(*case)
  if os.environ.get('LINGVO_EXT_REGOLDEN'):
    os.makedirs(_GOLDEN, exist_ok=True)
    with open(path, 'w') as f:
      f.write(text)
  with open(path) as f:
    golden = f.read()
  assert text == golden, path
  assert schedules.ParseLists(golden) == _Lists(*case)


def test_every_schedule_has_golden_files_and_every_file_a_case():
  cases = {_File(*c) for c in _Cases()}
  files = {os.path.join(_GOLDEN, f) for f in os.listdir(_GOLDEN)}
  assert files == cases
  names = {_NAME.match(os.path.basename(f)).group(1) for f in files}
  assert names == set(records.ACTION_SCHEDULES)


def test_lists_round_trip_through_text():
  rng = random.Random(0)
  tried = 0
  for _ in range(300):
    name = rng.choice(sorted(records.ACTION_SCHEDULES))
    d = rng.randint(1, 4)
    k = d * rng.randint(1, 3)
    m = rng.randint(1, 9)
    try:
      lists = _Lists(name, k, d, m, rng.random() < 0.5)
    except ValueError:
      continue
    tried += 1
    assert schedules.ParseLists(schedules.FormatLists(lists)) == lists
    assert all(isinstance(a.kind, schedules.Kind)
               for acts in schedules.ParseLists(schedules.FormatLists(lists))
               for a in acts)
  assert tried > 100


@pytest.mark.parametrize('text,error', [
    ('dev1: F0.0', 'line 1'),
    ('dev0: F0.0\ndev0: B0.0', 'line 2'),
    ('dev0: X0.0', "'X0.0' is not an action"),
    ('dev0: F0', "'F0' is not an action"),
])
def test_bad_text_names_its_line(text, error):
  with pytest.raises(ValueError, match=re.escape(error)):
    schedules.ParseLists(text)


def test_text_form():
  lists = schedules.ParseLists('# a comment\ndev0: F0.0 B0.0\n\ndev1:\n')
  assert lists == [[schedules.Action(schedules.Kind.F, 0, 0),
                    schedules.Action(schedules.Kind.B, 0, 0)], []]
  assert schedules.FormatLists(lists) == 'dev0: F0.0 B0.0\ndev1:'
