"""Shared test set-up: lingvo_ext first, so oneDNN is off before TF loads."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lingvo_ext  # pylint: disable=unused-import,g-import-not-at-top
