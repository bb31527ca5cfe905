"""What squeue and sinfo say about a sweep's SLURM jobs, told while the sweep waits.

hydra-submitit-launcher waits silently while a job pends, and a job no node of its partition can
start pends forever. `PendingWatch` polls squeue in a thread and, once a job has pended past a
threshold, prints squeue's reason and, when the job asks more than the partition gives, the
override to change. sinfo's facts also serve slurm_submit.py's advice.
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("amp_lab.sweeps")


@dataclass(frozen=True)
class QueuedJob:
    """One line of `squeue`: a job of the sweep and what it asks for."""

    job_id: str
    state: str
    reason: str
    cpus: int
    mem_gb: float | None  # None: the job asks no memory
    partition: str


def slurm_said(command: list[str], stream: str = "stdout") -> str:
    """What a SLURM client printed on `stream`; '' without a SLURM client or on a time-out."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):  # no SLURM client here, a slow controller
        return ""
    return str(getattr(done, stream))


def mem_gb(text: str) -> float | None:
    """squeue/sinfo memory ('64G', '4000M', '23081' MB) in GB; None when none is asked."""
    found = re.fullmatch(r"([\d.]+)([KMGT]?)\+?", text.strip())
    if not found or float(found.group(1)) == 0:
        return None
    scale = {"K": 1 / 1024**2, "M": 1 / 1024, "": 1 / 1024, "G": 1.0, "T": 1024.0}
    return float(found.group(1)) * scale[found.group(2)]


def queued_jobs(job_ids: list[str]) -> list[QueuedJob]:
    """The sweep's jobs that squeue still lists (one line per array task)."""
    if not job_ids:
        return []
    out = slurm_said(
        ["squeue", "-h", "-r", "-j", ",".join(sorted(set(job_ids))), "-o", "%i|%T|%r|%C|%m|%P"]
    )
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 6 and parts[3].isdigit():
            jobs.append(
                QueuedJob(parts[0], parts[1], parts[2], int(parts[3]), mem_gb(parts[4]), parts[5])
            )
    return jobs


def sinfo(partition: str | None, fields: str) -> list[str]:
    """sinfo's lines in the format `fields` (its -o), for one partition or (None) all."""
    return slurm_said(
        ["sinfo", "-h", *(["-p", partition] if partition else []), "-o", fields]
    ).split()


def partitions() -> list[str]:
    """The cluster's partitions, as sinfo lists them; the default one is marked with '*'."""
    return list(dict.fromkeys(sinfo(None, "%P")))


def partition_size(partition: str) -> tuple[int, float | None]:
    """(CPUs, GB) of the partition's largest node."""
    sizes = [
        (int(c), mem_gb(m))
        for c, m in (line.split("|") for line in sinfo(partition, "%c|%m"))
        if c.isdigit()
    ]
    if not sizes:
        return 0, None
    return max(c for c, _ in sizes), max((m for _, m in sizes if m is not None), default=None)


def minutes(limit: str) -> int | None:
    """A SLURM time limit ('2-00:00:00', '4:00:00', '30:00', '90') in whole minutes; None for
    'infinite' or anything else."""
    found = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit.strip())
    if not found:
        return None
    days, first, second, third = (int(g) if g else None for g in found.groups())
    if days is not None or third is not None:  # D-H[:M[:S]] or H:M:S
        hours, mins = first or 0, second or 0
    else:  # M or M:S
        hours, mins = 0, first or 0
    return (days or 0) * 1440 + hours * 60 + mins


def max_minutes(partition: str) -> int | None:
    """The partition's time limit per job (sinfo's MaxTime) in minutes; None when unlimited."""
    limits = [m for m in map(minutes, sinfo(partition, "%l")) if m is not None]
    return max(limits, default=None)


def advice(jobs: list[QueuedJob], seconds: float) -> str:
    """One line for jobs alike: how long they have pended, squeue's reason, what to change."""
    job = jobs[0]
    asks = f"{job.cpus} CPUs" + (f" / {job.mem_gb:g} GB" if job.mem_gb else "")
    names = ", ".join(j.job_id for j in jobs)
    line = (
        f"SLURM job{'s' if len(jobs) > 1 else ''} {names} pending for {seconds:.0f} s "
        f"({job.reason}): {'each ' if len(jobs) > 1 else ''}asks {asks}"
    )
    limit = max_minutes(job.partition) if job.reason == "PartitionTimeLimit" else None
    if limit is not None:
        return (
            f"{line}; partition {job.partition} allows {limit} min per job: set "
            f"hydra.launcher.timeout_min={limit}"
        )
    cpus, mem = partition_size(job.partition)
    too_big = [
        name
        for name, fits in (
            ("cpus_per_task", job.cpus <= cpus),
            ("mem_gb", not job.mem_gb or not mem or job.mem_gb <= mem),
        )
        if not fits
    ]
    if cpus and too_big:
        has = f"{cpus} CPUs" + (f" / {mem:.0f} GB" if mem else "")
        return (
            f"{line}; partition {job.partition} has {has} per node: set "
            f"{' / '.join('hydra.launcher.' + n for n in too_big)} (or "
            "hydra/launcher=submitit_slurm_cpu on a small cluster)"
        )
    return f"{line}; waiting for a free node (squeue -j {job.job_id} shows the queue)"


def submitted_ids(sweep_dir: Path) -> list[str]:
    """Job ids of the sweep: submitit keeps a folder per job in <sweep dir>/.submitit/."""
    folder = sweep_dir / ".submitit"
    return [p.name.split("_")[0] for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []


class PendingWatch:
    """A daemon thread that tells, once per job and reason, why a job pends past `warn_s`."""

    def __init__(self, sweep_dir: Path, warn_s: float) -> None:
        self.sweep_dir, self.warn_s = sweep_dir, warn_s
        self.stop = threading.Event()
        self.first_seen: dict[str, float] = {}
        self.told: set[tuple[str, str]] = set()
        self.thread = threading.Thread(target=self._run, name="amp_lab-pending", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()

    def _run(self) -> None:
        while not self.stop.wait(min(10.0, max(1.0, self.warn_s / 2))):
            self.poll()

    def poll(self) -> None:
        now = time.monotonic()
        due: dict[tuple[str, int, float | None, str], list[QueuedJob]] = {}
        for job in queued_jobs(submitted_ids(self.sweep_dir)):
            if job.state != "PENDING":
                continue
            seconds = now - self.first_seen.setdefault(job.job_id, now)
            if seconds >= self.warn_s and (job.job_id, job.reason) not in self.told:
                self.told.add((job.job_id, job.reason))
                due.setdefault((job.reason, job.cpus, job.mem_gb, job.partition), []).append(job)
        for jobs in due.values():  # jobs alike (a sweep's array) share one line
            log.warning("%s", advice(jobs, now - self.first_seen[jobs[0].job_id]))
