"""A sweep's jobs: the end of a sweep (jobs.py, any launcher), and on SLURM what squeue and sinfo
say (slurm_queue.py) and what sbatch and sacct say (slurm_submit.py)."""
