"""CPU threads and DataLoader workers sized to the CPUs this process was given.

torch starts one thread per core of the machine, and threads fighting over a job's few cores make
a small model several times slower: the budget is the affinity mask, capped by SLURM_CPUS_PER_TASK.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThreadPlan:
    """How many torch threads and DataLoader workers this run uses, and why."""

    cpus: int  # CPUs this process may use
    cpus_from: str  # where that number came from
    threads: int  # torch intra-op threads
    threads_from: str  # trainer.threads | OMP_NUM_THREADS | cpus less workers
    workers: int  # DataLoader worker processes


def plan_threads(threads: int, workers: int) -> ThreadPlan:
    """trainer.threads (0: auto) and data.num_workers, fitted to the CPU budget."""
    if hasattr(os, "sched_getaffinity"):
        cpus, cpus_from = len(os.sched_getaffinity(0)), "sched_getaffinity"
    else:  # macOS, Windows: no affinity mask
        cpus, cpus_from = os.cpu_count() or 1, "cpu_count"
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and 0 < int(slurm) < cpus:
        cpus, cpus_from = int(slurm), "SLURM_CPUS_PER_TASK"
    # each worker is a process that wants a core of its own; the main process keeps one
    capped = min(workers, max(0, cpus - 1))
    if capped < workers:
        log.warning(
            "data.num_workers=%d exceeds the %d CPU(s) this job has (%s): using %d worker(s)",
            workers,
            cpus,
            cpus_from,
            capped,
        )
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if threads > 0:
        count, source = threads, "trainer.threads"
    elif omp.isdigit() and int(omp) > 0:  # the user (or the cluster) already chose
        count, source = int(omp), "OMP_NUM_THREADS"
    else:
        count, source = max(1, cpus - capped), "cpus less workers"
    return ThreadPlan(cpus, cpus_from, count, source, capped)


def apply_threads(threads: int, workers: int) -> ThreadPlan:
    """Set torch's thread count from the plan; returns the plan (recorded in summary.json)."""
    plan = plan_threads(threads, workers)
    torch.set_num_threads(plan.threads)
    return plan
