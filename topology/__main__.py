"""``python -m topology``: the same command as ``consumer topology``.

The topology package is the lower layer and imports nothing of the consumer's; this alias runs the
consumer's command in its place rather than importing it.
"""

import os
import sys

os.execv(sys.executable, [sys.executable, "-m", "consumer", "topology", *sys.argv[1:]])
