"""MkDocs hook (mkdocs.yml `hooks:`): the schedule pictures of docs/schedules.md.

Draws `img/schedules/<name>.svg` for every schedule with action lists, with
`lingvo_ext.tools.timeline`, into a temporary directory the build reads:
the pictures are always the current lists, and nothing is written to docs/.
"""

import os
import tempfile

from mkdocs.structure.files import File

from lingvo_ext.core import actions
from lingvo_ext.tools import timeline

_tmp = None


def Pictures(out_dir):
  """Draws each schedule's planned timeline; returns the paths, relative."""
  written = []
  os.makedirs(os.path.join(out_dir, 'img', 'schedules'), exist_ok=True)
  for name in sorted(actions.ACTION_SCHEDULES):
    # 4 cells on 4 devices; schedules that need more cells than devices
    # (interleaved) get 2 per device.
    for stages in (4, 8):
      spec = actions.StageSpec(num_stages=stages, num_devices=4,
                               num_micro_batches=8)
      try:
        actions.Build(name, spec)
      except ValueError:
        continue
      if name == 'interleaved_1f1b' and stages == 4:
        continue  # One cell per device is plain 1F1B.
      rel = os.path.join('img', 'schedules', name + '.svg')
      timeline.DrawPlanned(name, spec, os.path.join(out_dir, rel))
      written.append(rel)
      break
  return written


def on_files(files, config):  # pylint: disable=invalid-name
  global _tmp
  _tmp = tempfile.TemporaryDirectory(prefix='lingvo_ext_docs_')
  for rel in Pictures(_tmp.name):
    files.append(File(rel, _tmp.name, config['site_dir'],
                      config['use_directory_urls']))
  return files


def on_post_build(config):  # pylint: disable=invalid-name,unused-argument
  if _tmp is not None:
    _tmp.cleanup()
