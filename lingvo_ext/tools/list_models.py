r"""Prints every registered lingvo_ext experiment name, one per line.

  .venv/bin/python -m lingvo_ext.tools.list_models [module ...]

Lists the bundled experiments (params/), plus those of each
named module (imported from PYTHONPATH, as `--model=module.Class` does).
Pass a name to --model of `.venv/bin/python -m lingvo_ext.trainer`.
"""

import sys

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-bad-import-order
from lingvo_ext import registry


def RegisteredModels():
  """Sorted names of the registered experiments (imports the bundled ones)."""
  return registry.RegisteredModels()


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  for module in argv:
    error = registry.ImportModule(module)
    if error:
      print(f'error: {error}', file=sys.stderr)
      return 2
  for name in RegisteredModels():
    print(name)
  return 0


if __name__ == '__main__':
  sys.exit(main())
