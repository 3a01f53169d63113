"""lingvo_ext: GPipe pipeline parallelism and friends on Lingvo."""

import os
import sys

# oneDNN's fused CPU kernels change numerics enough to break Lingvo's own
# evolved-transformer tests; it must be off before TensorFlow is imported.
if 'tensorflow' in sys.modules and os.environ.get('TF_ENABLE_ONEDNN_OPTS') != '0':
  import warnings
  warnings.warn('lingvo_ext was imported after TensorFlow; set '
                'TF_ENABLE_ONEDNN_OPTS=0 in the environment, or import '
                'lingvo_ext first, to turn oneDNN off.')
os.environ['TF_ENABLE_ONEDNN_OPTS'] = '0'
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
