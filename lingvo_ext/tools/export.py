"""lingvo-ext-export: a trained checkpoint to a SavedModel (docs/serving.md).

  .venv/bin/lingvo-ext-export --model=lm.TransformerLmTinyGPipe \\
      --logdir=/tmp/lm --export_dir=/tmp/lm_export

The library is lingvo_ext.serving.export; --help lists the flags.
"""

import sys

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-bad-import-order
from lingvo_ext.serving import export


def main(argv=None):
  return export.main(argv)


if __name__ == '__main__':
  sys.exit(main())
