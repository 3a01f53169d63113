"""docs/img/schedules/: the committed schedule pictures are current.

docs/schedules.md shows them (on the built site and the repository's page);
scripts/docs_hooks.py draws them with lingvo_ext.tools.timeline.
"""

import importlib.util
import os
import re
import shutil

from tests.support import ROOT


def _Hooks():
  spec = importlib.util.spec_from_file_location(
      'docs_hooks', os.path.join(ROOT, 'scripts', 'docs_hooks.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_committed_pictures_equal_what_timeline_draws_now(tmp_path):
  hooks = _Hooks()
  assert hooks.Stale() == []
  # Each schedule with action lists has one, and the page shows each.
  page = open(os.path.join(ROOT, 'docs', 'schedules.md')).read()
  shown = set(re.findall(r'\]\((img/schedules/[\w]+\.svg)\)', page))
  committed = {'img/schedules/' + f for f in os.listdir(
      os.path.join(ROOT, 'docs', 'img', 'schedules'))}
  assert shown == committed and 'img/schedules/zbv.svg' in shown
  # A picture that no longer matches is named.
  docs = tmp_path / 'docs'
  shutil.copytree(os.path.join(ROOT, 'docs', 'img'), docs / 'img')
  with open(docs / 'img' / 'schedules' / '1f1b.svg', 'a') as f:
    f.write('\n')
  (docs / 'img' / 'schedules' / 'old.svg').write_text('<svg/>')
  assert hooks.Stale(str(docs)) == [os.path.join('img', 'schedules', n)
                                    for n in ('1f1b.svg', 'old.svg')]
