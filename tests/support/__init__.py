"""What the tests share: the zygote server, the test libraries and probes.

ROOT is the repository's root, the same for a test at any depth of tests/.
"""

import os

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
