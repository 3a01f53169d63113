"""lingvo_ext: GPipe pipeline parallelism and friends on Lingvo."""

from lingvo_ext import _moved
from lingvo_ext import _startup
from lingvo_ext._internal import deferred

# TensorFlow's start-up lines are noise for users; their own
# TF_CPP_MIN_LOG_LEVEL wins (lingvo_ext/_startup.py).
_startup.Install()
# Optional modules TensorFlow's and Lingvo's imports load but a run never
# uses (scikit-learn, scipy.stats): imported when first used.
deferred.Install()
# Modules that moved keep their old import paths (lingvo_ext/_moved.py).
_moved.Install()
