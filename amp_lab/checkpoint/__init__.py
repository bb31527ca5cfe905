"""Requeue-safe checkpoints: the checkpoint files, the run directory's records, stop signals."""
