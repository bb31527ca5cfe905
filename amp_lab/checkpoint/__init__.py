"""Requeue-safe checkpoints, by job: `store` (the checkpoint files: atomic writes, weights-only
loads, the newest N kept, corrupt ones set aside), `sharded` (FSDP2 runs' checkpoint folders,
written by every rank through torch.distributed.checkpoint), `run_dir` (the run directory's records:
settings.json, finished-run detection, old files set aside) and `signals` (stop signals caught
and handed on). Which settings may change on resume is field metadata in amp_lab/config.py."""
