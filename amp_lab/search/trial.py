"""A run that is a search trial reports each evaluation to its study and stops when pruned.

The sweeper names the trial in the job's environment (`TRIAL_ENV`, through `hydra.job.env_set`,
so on any launcher); a run without it gets no sink."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from amp_lab.search.study import PRUNED_MARK, storage
from amp_lab.tracking.sinks import Record, Sink

# {"sweep_dir", "storage": URL or null, "study", "trial": number, "report": "val/loss",
#  "pruner": {..}}
TRIAL_ENV = "AMP_LAB_SEARCH_TRIAL"


class TrialPruned(Exception):
    """The study's pruner stopped this run; its summary's status says so."""


def env_override(spec: dict[str, Any]) -> str:
    """The override that names the trial and its pruner (TRIAL_ENV) to the job (quoted: a path
    may hold any character)."""
    value = json.dumps(spec).replace("\\", "\\\\").replace("'", "\\'")
    return f"++hydra.job.env_set.{TRIAL_ENV}='{value}'"


def pruning_sinks() -> list[Sink]:
    """The pruning sink when this run is a search trial, else nothing."""
    spec = os.environ.get(TRIAL_ENV)
    return [PruningSink(spec)] if spec else []


class PruningSink(Sink):
    """Reports each evaluation (its loss, or its accuracy for an accuracy objective) to the
    trial, a non-finite loss too: Optuna's MedianPruner prunes a trial whose every reported value
    is NaN, and its samplers rank such a trial last. Raises TrialPruned when the pruner says so."""

    def __init__(self, spec: str) -> None:
        self.spec: dict[str, Any] = json.loads(spec)
        self.trial: Any = None

    def start(self, info: Record) -> None:
        import optuna

        spec = self.spec
        median = spec["pruner"]
        pruner = optuna.pruners.MedianPruner(**median) if median else optuna.pruners.NopPruner()
        where = optuna.storages.get_storage(storage(Path(spec["sweep_dir"]), spec["storage"]))
        study = optuna.load_study(study_name=spec["study"], storage=where, pruner=pruner)
        study_id = where.get_study_id_from_name(spec["study"])
        trial_id = where.get_trial_id_from_study_id_trial_number(study_id, spec["trial"])
        self.trial = optuna.trial.Trial(study, trial_id)

    def log(self, record: Record) -> None:
        key = self.spec["report"]
        if record.get("kind") != "val" or (value := record.get(key)) is None:
            return
        step = int(record["step"])
        self.trial.report(float(value), step)
        if self.trial.should_prune():
            raise TrialPruned(f"{PRUNED_MARK} at step {step} ({key} {value:.4g})")
