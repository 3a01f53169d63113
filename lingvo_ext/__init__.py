"""lingvo_ext: GPipe pipeline parallelism and friends on Lingvo."""

from lingvo_ext import _moved
from lingvo_ext._internal import deferred

# Optional modules TensorFlow's and Lingvo's imports load but a run never
# uses (scikit-learn, scipy.stats): imported when first used.
deferred.Install()
# Modules that moved keep their old import paths (lingvo_ext/_moved.py).
_moved.Install()
