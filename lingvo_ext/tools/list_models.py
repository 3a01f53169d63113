r"""Prints every registered lingvo_ext experiment name, one per line.

  python -m lingvo_ext.tools.list_models

Pass a name to --model of `python -m lingvo_ext.trainer`.
"""

import os
import sys

import lingvo_ext  # pylint: disable=unused-import,g-bad-import-order


def RegisteredModels():
  """Sorted names of the registered experiments (imports `params`)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  if root not in sys.path:
    sys.path.append(root)
  import params  # pylint: disable=unused-import,g-import-not-at-top
  from lingvo import model_registry  # pylint: disable=g-import-not-at-top
  # The helper's map, not model_registry.GetAllRegisteredClasses(): that one
  # first tries to import all of lingvo.tasks' params, printing a line for
  # each.
  helper = model_registry._ModelRegistryHelper  # pylint: disable=protected-access
  return sorted(helper.GetAllRegisteredClasses())


def main():
  for name in RegisteredModels():
    print(name)
  return 0


if __name__ == '__main__':
  sys.exit(main())
