"""lingvo_ext: GPipe pipeline parallelism and friends on Lingvo."""

import os

# TensorFlow's C++ info logs are noise for users; their own setting wins.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
