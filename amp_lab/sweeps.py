"""The end of a sweep: which jobs amp_lab refused, told in the sweeping process's terminal.

A job whose config amp_lab refuses is skipped so that the others run. With the basic launcher
that happens in this process; with submitit (SLURM or local) it happens in the job's own
process, whose return value never reaches here. So the job leaves a marker, `refused.txt` in its
folder (`job N: reason`), and `SkippedJobs` (a Hydra callback, in conf/config.yaml) clears the
markers under the sweep folder when a launch starts and gathers them when it ends; the `amp_lab`
command then exits 2. A job that starts removes its folder's marker (a relaunch that now runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from amp_lab.records import REFUSED_FILE

skipped: list[str] = []  # "job N: reason" of this launch, for the command's exit code


def mark_refused(job_dir: Path, job: str, reason: str) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / REFUSED_FILE).write_text(f"job {job}: {reason}\n")


def clear_mark(job_dir: Path) -> None:
    (job_dir / REFUSED_FILE).unlink(missing_ok=True)


class SkippedJobs(Callback):
    """Markers of this launch only: cleared at its start, read after the launcher has waited
    for every job (any folder layout under the sweep folder)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        skipped.clear()
        for marker in Path(config.hydra.sweep.dir).rglob(REFUSED_FILE):
            marker.unlink(missing_ok=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        markers = Path(config.hydra.sweep.dir).rglob(REFUSED_FILE)
        skipped[:] = sorted(m.read_text(errors="replace").strip() for m in markers)
