"""Action lists as text, and back: one line per device.

    dev0: F0.0 F0.1 B0.1 B0.0
    dev1: F1.0 B1.0 F1.1 B1.1

Each action is its kind's letter, its stage and its micro-batch
('F1.3': stage 1's forward pass of micro-batch 3). `ParseLists(FormatLists(lists))`
gives the lists back, so a schedule's lists can be read, diffed and kept as
golden files (tests/pipeline/testdata/).
"""

import re

from lingvo_ext.pipeline.kinds import Action
from lingvo_ext.pipeline.kinds import Kind
from lingvo_ext.pipeline.kinds import ScheduleLists

_ACTION = re.compile(r'^([%s])(\d+)\.(\d+)$' % ''.join(k.value for k in Kind))
_LINE = re.compile(r'^dev(\d+):(.*)$')


def FormatLists(lists: ScheduleLists) -> str:
  """The lists as text: 'devD: A A ...', one line per device."""
  return '\n'.join('dev%d:%s' % (d, ''.join(' ' + str(a) for a in acts))
                   for d, acts in enumerate(lists))


def ParseLists(text: str) -> ScheduleLists:
  """The lists `FormatLists` wrote; ValueError naming the first bad line or word.

  Blank lines and lines starting with '#' are skipped; devices must come in
  order from dev0.
  """
  lists = []
  for n, line in enumerate(text.splitlines(), 1):
    line = line.strip()
    if not line or line.startswith('#'):
      continue
    match = _LINE.match(line)
    if not match or int(match.group(1)) != len(lists):
      raise ValueError('line %d: %r; expected "dev%d: F0.0 ..."' %
                       (n, line, len(lists)))
    acts = []
    for word in match.group(2).split():
      a = _ACTION.match(word)
      if not a:
        raise ValueError('line %d: %r is not an action (e.g. F0.1, B2.0)' %
                         (n, word))
      acts.append(Action(Kind(a.group(1)), int(a.group(2)), int(a.group(3))))
    lists.append(acts)
  return lists
