"""Shared test set-up: the repository on sys.path, lingvo_ext imported."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lingvo_ext  # pylint: disable=unused-import,g-import-not-at-top


def pytest_collection_modifyitems(items):
  # The end-to-end tests are the long ones: started first, they do not leave
  # one pytest-xdist worker busy at the end while the others wait.
  items.sort(key=lambda item: item.get_closest_marker('e2e') is None)
