"""The studies of a search, kept in one journal file in the sweep folder, and each trial's result
read from its run directory.

A trial's value is its run's final validation loss, from summary.json. A run the health judge
found diverged, or whose loss is not finite, is a FAILED trial: Optuna never averages it. A run
the pruner stopped is PRUNED. Trials left RUNNING by an interrupted sweep are failed as
interrupted (no result attribute) when the search resumes, and their settings are tried again
first; they do not count toward n_trials.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amp_lab.records import REFUSED_FILE, SEARCH_FILE, SUMMARY_FILE

if TYPE_CHECKING:  # optuna takes ~0.5 s to import: only a search imports it
    import optuna

JOB_DIR = "job_dir"  # a trial's user attributes: its run directory, relative to the sweep folder
RESULT = "result"  # how the run ended: completed, diverged, pruned at step N, crashed: ...
AXIS = "axis"  # a study's user attribute: its sweep overrides (["precision=fp32"])
PRUNED_MARK = "pruned by the search"  # the start of a pruned run's summary status
KINDS = {"COMPLETE": "completed", "PRUNED": "pruned", "FAIL": "failed"}  # in the verdict's tally


def storage(sweep_dir: Path) -> optuna.storages.BaseStorage:
    """The search's journal: appends under a file lock, safe for trials in other processes."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(sweep_dir / SEARCH_FILE)))


def outcome(job_dir: Path, error: str | None) -> tuple[str, float | None, str]:
    """(optuna TrialState name, value, result) of the run in `job_dir`, from its summary.json:
    the health judge's verdict read as the run recorded it, never judged again here. `error`:
    the job's exception, the result of a run that left no summary."""
    if (job_dir / REFUSED_FILE).exists():
        reason = (job_dir / REFUSED_FILE).read_text(errors="replace").strip()
        return "FAIL", None, f"refused: {reason.partition(': ')[2]}"
    try:
        summary: dict[str, Any] = json.loads((job_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return "FAIL", None, f"crashed: {error}" if error else "no readable summary.json"
    status = str(summary.get("status", "?"))
    if PRUNED_MARK in status:
        return "PRUNED", None, status.partition(": ")[2] or status
    if summary.get("diverged") or status == "diverged":
        return "FAIL", None, "diverged"
    if status != "completed":
        return "FAIL", None, status
    loss = summary.get("final_val_loss")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return "FAIL", None, f"diverged: final val loss {loss}"
    return "COMPLETE", float(loss), "completed"


def tell(
    study: optuna.Study, trial: optuna.Trial, job_dir: Path, sweep_dir: Path, error: str | None
) -> str:
    """Record the trial's outcome in the study, its run directory and result as attributes;
    returns the result."""
    from optuna.trial import TrialState

    state, value, result = outcome(job_dir, error)
    trial.set_user_attr(JOB_DIR, str(job_dir.resolve().relative_to(sweep_dir.resolve())))
    trial.set_user_attr(RESULT, result)
    study.tell(trial, value, state=TrialState[state])
    return result


def retry_interrupted(study: optuna.Study) -> int:
    """Fail the trials an interrupted sweep left running and queue their settings again."""
    from optuna.trial import TrialState

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for trial in stale:
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        study.enqueue_trial(trial.params)
    return len(stale)


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The trials that count toward n_trials: told a result (an interrupted one was not)."""
    return [t for t in study.trials if t.state.is_finished() and RESULT in t.user_attrs]


def verdict(study: optuna.Study) -> str:
    """One line: the best trial's settings and loss, or why there is none."""
    trials = finished(study)
    kinds = Counter(
        "diverged" if t.user_attrs[RESULT].startswith("diverged") else KINDS[t.state.name]
        for t in trials
    )
    tally = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    if not kinds["completed"]:
        return (
            f"search {study.study_name}: no trial of {len(trials)} finished with a finite loss "
            f"({tally}): no best setting; lower the space's upper bounds (hydra.sweeper.space)"
        )
    best = study.best_trial  # the least loss of the COMPLETE trials
    params = ", ".join(f"{k}={v:.4g}" for k, v in best.params.items())
    return (
        f"search {study.study_name}: best {params}: val loss {best.value:.4f} "
        f"(trial {best.number}; {len(trials)} trials: {tally})"
    )
