"""What squeue and sinfo say about a sweep's SLURM jobs, told while the sweep waits (submitit
waits silently, and a job no node can start pends forever): once a job has pended past a
threshold, squeue's reason and, when the job asks more than the partition gives, the override.
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
    """One line of `squeue`: a pending job of the sweep and what it asks for."""

    job_id: str
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


def pending_jobs(job_ids: list[str]) -> list[QueuedJob]:
    """The sweep's jobs that squeue lists as pending (one line per array task)."""
    if not job_ids:
        return []
    ids = ",".join(sorted(set(job_ids)))
    out = slurm_said(["squeue", "-h", "-r", "-t", "PENDING", "-j", ids, "-o", "%i|%r|%C|%m|%P"])
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 5 and parts[2].isdigit():
            jobs.append(QueuedJob(parts[0], parts[1], int(parts[2]), mem_gb(parts[3]), parts[4]))
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
    """(CPUs, GB) of the partition's largest node; 0 and None where sinfo does not say."""
    rows = [line.split("|") for line in sinfo(partition, "%c|%m")]
    cpus = max((int(c) for c, _ in rows if c.isdigit()), default=0)
    return cpus, max((gb for _, m in rows if (gb := mem_gb(m))), default=None)


def minutes(limit: str) -> int | None:
    """A SLURM time limit ('2-00:00:00', '4:00:00', '30:00', '90') in whole minutes; None for
    'infinite' or anything else."""
    found = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit.strip())
    if not found:
        return None
    days, first, second, _ = (int(g or 0) for g in found.groups())
    if found.group(1) or found.group(4):  # D-H[:M[:S]] or H:M:S
        return days * 1440 + first * 60 + second
    return first  # M or M:S


def time_fix(partition: str) -> str | None:
    """The override for a job over the partition's time limit (sinfo's MaxTime); None when
    the partition has none."""
    limit = max((m for m in map(minutes, sinfo(partition, "%l")) if m is not None), default=None)
    if limit is None:
        return None
    return (
        f"partition {partition} allows {limit} min per job: set hydra.launcher.timeout_min={limit}"
    )


def advice(jobs: list[QueuedJob], seconds: float) -> str:
    """One line for jobs alike: how long they have pended, squeue's reason, what to change."""
    job = jobs[0]
    asks = f"{job.cpus} CPUs" + (f" / {job.mem_gb:g} GB" if job.mem_gb else "")
    names = ", ".join(j.job_id for j in jobs)
    line = (
        f"SLURM job{'s' if len(jobs) > 1 else ''} {names} pending for {seconds:.0f} s "
        f"({job.reason}): {'each ' if len(jobs) > 1 else ''}asks {asks}"
    )
    if job.reason == "PartitionTimeLimit" and (fix := time_fix(job.partition)):
        return f"{line}; {fix}"
    cpus, mem = partition_size(job.partition)
    asked = (("cpus_per_task", job.cpus, cpus), ("mem_gb", job.mem_gb, mem))
    if too_big := [name for name, asks_for, has in asked if asks_for and has and asks_for > has]:
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
        for job in pending_jobs(submitted_ids(self.sweep_dir)):
            seconds = now - self.first_seen.setdefault(job.job_id, now)
            if seconds >= self.warn_s and (job.job_id, job.reason) not in self.told:
                self.told.add((job.job_id, job.reason))
                due.setdefault((job.reason, job.cpus, job.mem_gb, job.partition), []).append(job)
        for jobs in due.values():  # jobs alike (a sweep's array) share one line
            log.warning("%s", advice(jobs, now - self.first_seen[jobs[0].job_id]))
