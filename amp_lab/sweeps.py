"""The end of a sweep: which jobs amp_lab refused, told in the sweeping process's terminal.

A job whose config amp_lab refuses is skipped so that the others run (`__main__.main` logs
`job N skipped: <reason>` to the job's `__main__.log`). With the basic launcher that happens in
this process; with submitit (SLURM or local) it happens in the job's own process, whose return
value never reaches here. So at the end of every sweep, `SkippedJobs` (a Hydra callback, in
conf/config.yaml) reads the job folders: a folder with Hydra's `.hydra/` but no metrics.jsonl was
refused at start-up (or never ran), and its log says why. The `amp_lab` command then exits 2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

REFUSED = re.compile(r"job \S+ skipped: (.*)")
skipped: list[str] = []  # "job N: reason", for the command's exit code


def refused_jobs(sweep_dir: Path) -> list[str]:
    """`job N: reason` for each job folder of the sweep that holds no record."""
    found = []
    for job in sorted(p.parent for p in sweep_dir.glob("*/.hydra")):
        if (job / "metrics.jsonl").exists() or (job / "summary.json").exists():
            continue
        log = job / "__main__.log"
        reasons = REFUSED.findall(log.read_text(errors="replace")) if log.exists() else []
        found.append(f"job {job.name.split('_', 1)[0]}: "
                     f"{reasons[-1] if reasons else 'no records (see its folder)'}")
    return found


class SkippedJobs(Callback):
    """After the launcher has waited for every job: name the jobs that did not run."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        skipped[:] = refused_jobs(Path(config.hydra.sweep.dir))
