"""Shared setup for the rollout tests: one compute thread (the machine's cores are shared).

The reward and data tests do not need torch, so it is not imported here (that alone costs ~1.5 s);
OMP_NUM_THREADS reaches torch whenever a test imports it later.
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:
    sys.modules["torch"].set_num_threads(1)
