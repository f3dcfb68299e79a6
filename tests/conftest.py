"""Shared test setup: one torch thread (2-core machines, several test processes), no GPU, quiet Ray."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
