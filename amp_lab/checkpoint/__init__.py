"""Requeue-safe checkpoints: `store` (the files), `sharded` (FSDP2 folders), `run_dir` (the run
directory's records) and `signals` (stop signals caught and handed on)."""
