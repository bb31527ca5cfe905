"""The end of a sweep: each job's state, the jobs amp_lab refused, and the next command.

A refused job is skipped so that the others run, leaving a marker, `refused.txt` (`job N:
reason`), which `SkippedJobs` (a Hydra callback, conf/config.yaml) gathers when the launch ends;
the `amp_lab` command then exits 2. On SLURM it also watches the queue (slurm_queue.py) and has
sbatch's refusal and sacct's complaint said in one line each (slurm_submit.py).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from amp_lab.records import HYDRA_DIR, REFUSED_FILE, SUMMARY_FILE
from amp_lab.sweeps.slurm_queue import PendingWatch

if TYPE_CHECKING:  # imported on a SLURM launch only: submitit takes 0.1 s to import
    from amp_lab.sweeps.slurm_submit import SlurmSubmit

skipped: list[str] = []  # "job N: reason" of this launch, for the command's exit code
# the queue watch and the submission of this SLURM launch; not on the callback, which the
# launcher pickles into each job
watches: list[PendingWatch | SlurmSubmit] = []

# conf/hydra/launcher/submitit_slurm.yaml shadows the plugin's config of that name on purpose; set
# here, as every process that composes it (the sweep, each submitit job) imports this module
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_slurm' is validated")
# optuna 4 calls the search's pinned TPE arguments experimental (stable in 5); not in the
# sweeper's module: Hydra imports plugins inside catch_warnings, which drops a filter set there
warnings.filterwarnings(
    "ignore", message=r"Argument ``(multivariate|constant_liar)`` is an experimental feature"
)


def slurm_error_line(err: BaseException) -> str | None:
    """One line for sbatch's refusal of this launch's jobs (or a machine without SLURM), or None
    when err is another error; the launch has ended either way."""
    line = None
    while watches:
        watch = watches.pop()
        watch.close()
        if not isinstance(watch, PendingWatch):
            line = line or watch.error_line(err)
    return line


def mark_refused(job_dir: Path, job: str, reason: str) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / REFUSED_FILE).write_text(f"job {job}: {reason}\n")


def clear_mark(job_dir: Path) -> None:
    (job_dir / REFUSED_FILE).unlink(missing_ok=True)


def job_state(job_dir: Path) -> str:
    """A job folder's state: its summary's status, its refusal, or where to look."""
    summary, refused = job_dir / SUMMARY_FILE, job_dir / REFUSED_FILE
    if refused.exists():
        return "refused: " + refused.read_text(errors="replace").strip().partition(": ")[2]
    if summary.exists():
        try:
            data = json.loads(summary.read_text(errors="replace"))
        except ValueError:
            return "unreadable summary.json"
        best = data.get("best_val_acc")
        return f"{data.get('status')}" + (f", best val acc {best:.4f}" if best is not None else "")
    return "no summary.json (the job's log: .submitit/<job id>/*_log.err, or its folder's .log)"


def job_table(sweep_dir: Path) -> list[str]:
    """One line per job folder (it holds .hydra/), in job-number order."""
    dirs = sorted(
        {p.parent for p in sweep_dir.rglob(HYDRA_DIR)},
        key=lambda d: (
            int(d.name.split("_")[0]) if d.name.split("_")[0].isdigit() else 1 << 30,
            d.name,
        ),
    )
    return [f"  {d.relative_to(sweep_dir)}: {job_state(d)}" for d in dirs]


class SkippedJobs(Callback):
    """Markers of this launch only: cleared at its start, read once every job has ended. On
    SLURM, squeue's reason for a job that pends longer than `pending_warn_s`."""

    def __init__(self, pending_warn_s: float = 60.0) -> None:
        self.pending_warn_s = pending_warn_s

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        skipped.clear()
        sweep_dir = Path(config.hydra.sweep.dir)
        for marker in sweep_dir.rglob(REFUSED_FILE):
            marker.unlink(missing_ok=True)
        launcher = config.hydra.launcher
        if str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
            from amp_lab.sweeps.slurm_submit import SlurmSubmit

            tasks = int(launcher.get("tasks_per_node") or 1)
            started: list[PendingWatch | SlurmSubmit] = [
                SlurmSubmit(sweep_dir, launcher.get("partition"), tasks),
                PendingWatch(sweep_dir, self.pending_warn_s),
            ]
            for watch in started:
                watch.start()
            watches.extend(started)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        while watches:
            watches.pop().close()
        sweep_dir = Path(config.hydra.sweep.dir)
        markers = sweep_dir.rglob(REFUSED_FILE)
        skipped[:] = sorted(m.read_text(errors="replace").strip() for m in markers)
        lines = job_table(sweep_dir)
        print(
            f"amp_lab: sweep {sweep_dir}: {len(lines)} job(s)",
            *lines,
            f"next: amp_lab report {sweep_dir}",
            sep="\n",
            file=sys.stderr,
        )
