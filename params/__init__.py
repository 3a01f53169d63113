"""Registered lingvo_ext experiments.

Importing this package registers every experiment with
`lingvo.model_registry`: `params/lm.py` as lm.<Class>, `params/image.py` as
image.<Class> (Lingvo keys a class by its module path less 'params.').
"""

from params import image  # pylint: disable=unused-import
from params import lm  # pylint: disable=unused-import
