"""Shared test set-up: the repository on sys.path, lingvo_ext imported."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lingvo_ext  # pylint: disable=unused-import,g-import-not-at-top
