"""lingvo_ext: GPipe pipeline parallelism and friends on Lingvo."""

from lingvo_ext import _startup

# TensorFlow's start-up lines are noise for users; their own
# TF_CPP_MIN_LOG_LEVEL wins (lingvo_ext/_startup.py).
_startup.Install()
