"""A run that is a search trial reports its validation loss to the study and stops when pruned.

The sweeper names the trial in the job's environment (`TRIAL_ENV`, set through Hydra's
`hydra.job.env_set`, so it reaches the job on any launcher); a run without it gets no sink and
the trainer never hears of Optuna.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from amp_lab.search.study import PRUNED_MARK, storage
from amp_lab.tracking.sinks import Record, Sink

TRIAL_ENV = "AMP_LAB_SEARCH_TRIAL"  # {"sweep_dir", "study", "trial": number, "pruner": {..}}


class TrialPruned(Exception):
    """The study's pruner stopped this run; its summary's status says so."""


def env_override(study: str, trial: int, sweep_dir: Path, pruner: dict[str, int]) -> str:
    """The override that names the trial and its MedianPruner's settings to the job (quoted: a
    path may hold any character)."""
    where = {"sweep_dir": str(sweep_dir.resolve()), "study": study, "trial": trial}
    spec = json.dumps({**where, "pruner": pruner})
    value = spec.replace("\\", "\\\\").replace("'", "\\'")
    return f"++hydra.job.env_set.{TRIAL_ENV}='{value}'"


def pruning_sinks() -> list[Sink]:
    """The pruning sink when this run is a search trial, else nothing."""
    spec = os.environ.get(TRIAL_ENV)
    return [PruningSink(spec)] if spec else []


class PruningSink(Sink):
    """Reports each evaluation's loss to the trial; raises TrialPruned when the pruner says so."""

    def __init__(self, spec: str) -> None:
        self.spec: dict[str, Any] = json.loads(spec)
        self.trial: Any = None

    def start(self, info: Record) -> None:
        import optuna

        journal, name = storage(Path(self.spec["sweep_dir"])), self.spec["study"]
        pruner = optuna.pruners.MedianPruner(**self.spec["pruner"])
        study = optuna.load_study(study_name=name, storage=journal, pruner=pruner)
        study_id = journal.get_study_id_from_name(name)
        trial_id = journal.get_trial_id_from_study_id_trial_number(study_id, self.spec["trial"])
        self.trial = optuna.trial.Trial(study, trial_id)

    def log(self, record: Record) -> None:
        loss = record.get("val/loss")
        if record.get("kind") != "val" or loss is None or not math.isfinite(loss):
            return  # a non-finite loss is the health judge's to call diverged, not the pruner's
        step = int(record["step"])
        self.trial.report(float(loss), step)
        if self.trial.should_prune():
            raise TrialPruned(f"{PRUNED_MARK} at step {step} (val loss {loss:.4g})")
