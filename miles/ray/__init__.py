"""Orchestration: the rollout manager, the training worker group and the driver loop, on Ray."""
