"""The schedule pictures of docs/schedules.md, committed and kept current.

`img/schedules/<name>.svg`, one for every schedule with action lists, lives
in docs/img/schedules/ (so it renders on the repository's page too), as
`lingvo_ext.tracing.timeline` draws it. As an MkDocs hook (mkdocs.yml
`hooks:`) it draws them again and stops the build where a committed one
differs; tests/docs/test_schedule_pictures.py checks the same. Redraw them:

  .venv/bin/python scripts/docs_hooks.py
"""

import filecmp
import os
import sys
import tempfile

from lingvo_ext.pipeline import kinds
from lingvo_ext.pipeline import records
from lingvo_ext.tracing import timeline

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'docs')
SUBDIR = os.path.join('img', 'schedules')


def Pictures(out_dir):
  """Draws each schedule's planned timeline; returns the paths, relative."""
  written = []
  os.makedirs(os.path.join(out_dir, SUBDIR), exist_ok=True)
  for name in sorted(records.ACTION_SCHEDULES):
    # 4 cells on 4 devices; schedules that need more cells than devices
    # (interleaved) get 2 per device.
    for stages in (4, 8):
      spec = kinds.StageSpec(num_stages=stages, num_devices=4,
                               num_micro_batches=8)
      try:
        records.Build(name, spec)
      except ValueError:
        continue
      if name == 'interleaved_1f1b' and stages == 4:
        continue  # One cell per device is plain 1F1B.
      rel = os.path.join(SUBDIR, name + '.svg')
      timeline.DrawPlanned(name, spec, os.path.join(out_dir, rel))
      written.append(rel)
      break
  return written


def Stale(docs_dir=DOCS):
  """The pictures under `docs_dir` that differ from those drawn now (or are
  missing, or are no schedule's), relative paths; [] if all are current."""
  with tempfile.TemporaryDirectory(prefix='lingvo_ext_docs_') as tmp:
    drawn = Pictures(tmp)
    stale = [rel for rel in drawn
             if not os.path.exists(os.path.join(docs_dir, rel)) or
             not filecmp.cmp(os.path.join(tmp, rel),
                             os.path.join(docs_dir, rel), shallow=False)]
  folder = os.path.join(docs_dir, SUBDIR)
  extra = [os.path.join(SUBDIR, f) for f in sorted(os.listdir(folder))
           if os.path.join(SUBDIR, f) not in drawn] if os.path.isdir(
               folder) else []
  return stale + extra


def on_files(files, config):  # pylint: disable=invalid-name
  stale = Stale(config['docs_dir'])
  if stale:
    from mkdocs.exceptions import PluginError  # pylint: disable=g-import-not-at-top
    raise PluginError(
        'the schedule pictures %s differ from what '
        'lingvo_ext.tracing.timeline draws now; redraw them: .venv/bin/python scripts/docs_hooks.py' %
        ', '.join(stale))
  return files


def main():
  folder = os.path.join(DOCS, SUBDIR)
  drawn = Pictures(DOCS)
  for f in sorted(os.listdir(folder)):
    if os.path.join(SUBDIR, f) not in drawn:
      os.remove(os.path.join(folder, f))
  print('\n'.join(os.path.join('docs', rel) for rel in drawn))
  return 0


if __name__ == '__main__':
  sys.exit(main())
