"""Evaluation runs (`miles eval`) and their metric names (`eval/<dataset>/...`)."""
