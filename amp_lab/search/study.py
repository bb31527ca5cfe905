"""The studies of a search, kept in one journal file in the sweep folder (or the storage named),
and each trial's result read from its run directory.

A run that diverged or that the pruner stopped is a PRUNED trial (Optuna's samplers rank it below
every completed one, where a FAILED trial would teach them nothing); one that crashed or was
refused is FAILED and counts toward max_failure_rate. Trials an interrupted sweep left RUNNING are
failed when the search resumes and their settings tried again first.
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
RESULT = "result"  # how the run ended: completed, diverged, pruned at ..., crashed: ...
AXIS = "axis"  # a study's user attributes: its study_per overrides (["precision=fp32"]),
OBJECTIVE = "objective"  # and the summary.json figure it scores
PRUNED_MARK = "pruned by the search"  # the start of a pruned run's summary status
# summary.json's figures a search can score: an accuracy is maximized (its trials report val/acc
# to the pruner), a loss, a time or a step count to the target minimized (they report val/loss)
OBJECTIVES = "final_val_loss final_val_acc best_val_acc time_to_target_s steps_to_target".split()


def objective(name: str, direction: str | None) -> tuple[str, str]:
    """(the direction, the evaluation's record a trial reports) of the objective `name`; a
    direction against the objective's is refused (a search that maximizes a loss is a typo)."""
    from amp_lab.errors import did_you_mean
    from amp_lab.search.space import SearchError

    if name not in OBJECTIVES:
        raise SearchError(
            f"hydra.sweeper.objective={name} is not a figure a search scores"
            f"{did_you_mean(name, OBJECTIVES)} (use one of {', '.join(OBJECTIVES)})"
        )
    own, report = ("maximize", "val/acc") if name.endswith("_acc") else ("minimize", "val/loss")
    if direction not in (None, own):
        raise SearchError(
            f"hydra.sweeper.direction={direction}: {name} is {own[:-1]}ed (one objective; drop "
            f"direction or set it to {own})"
        )
    return own, report


def used(value: Any) -> Any:
    """A drawn value as its trial runs it: a float to 4 significant digits (short job folder
    names), an int or a choice as it is."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def value_text(value: Any) -> str:
    """A drawn value as an override's value."""
    return "null" if value is None else str(used(value))


def storage(sweep_dir: Path, url: str | None = None) -> optuna.storages.BaseStorage | str:
    """`url` (an Optuna storage URL), else the sweep's journal: appends under a file lock, safe
    for trials in other processes."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return url or JournalStorage(JournalFileBackend(str(sweep_dir / SEARCH_FILE)))


def outcome(job_dir: Path, error: str | None, objective: str) -> tuple[str, float | None, str]:
    """(optuna TrialState name, value, result) of the run in `job_dir`, from its summary.json;
    `error`: the job's exception, the result of a run that left no summary."""
    if (job_dir / REFUSED_FILE).exists():
        reason = (job_dir / REFUSED_FILE).read_text(errors="replace").strip()
        return "FAIL", None, f"refused: {reason.partition(': ')[2]}"
    try:
        summary: dict[str, Any] = json.loads((job_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return "FAIL", None, f"crashed: {error or 'no readable summary.json'}"
    status, loss = str(summary.get("status", "?")), summary.get("final_val_loss")
    finite = isinstance(loss, (int, float)) and math.isfinite(loss)
    if PRUNED_MARK in status:
        pruned = status.partition(": ")[2] or status
        return "PRUNED", None, pruned if finite else f"diverged: {pruned}"
    if summary.get("diverged") or status == "diverged":  # the health judge's verdict
        return "PRUNED", None, "diverged"
    if status != "completed":  # crashed: ..., interrupted: ...
        return "FAIL", None, status if status.startswith("crashed") else f"crashed: {status}"
    if not finite:
        return "PRUNED", None, f"diverged: final val loss {loss}"
    value = summary.get(objective)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "PRUNED", None, f"missed: {objective} is {value}"  # e.g. the target never reached
    return "COMPLETE", float(value), "completed"


def tell(
    study: optuna.Study,
    trial: optuna.Trial,
    job_dir: Path,
    sweep_dir: Path,
    error: str | None,
    objective: str,
) -> tuple[str, str]:
    """Record the trial's outcome in the study, its run directory and result as attributes;
    returns its state's name and result."""
    from optuna.trial import TrialState

    state, value, result = outcome(job_dir, error, objective)
    trial.set_user_attr(JOB_DIR, str(job_dir.resolve().relative_to(sweep_dir.resolve())))
    trial.set_user_attr(RESULT, result)
    study.tell(trial, value, state=TrialState[state])
    return state, result


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


def kind(trial: optuna.trial.FrozenTrial) -> str:
    """completed, pruned, diverged, missed, crashed or refused: the result's first word."""
    return str(trial.user_attrs[RESULT]).split(":")[0].split()[0]


def best(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The best COMPLETE trial in the study's direction, or None."""
    return study.best_trial if any(t.state.name == "COMPLETE" for t in study.trials) else None


def verdict(study: optuna.Study) -> str:
    """One line: the best trial's settings and value, or why there is none (a crash named)."""
    trials, objective = finished(study), study.user_attrs.get(OBJECTIVE, "final_val_loss")
    kinds = Counter(kind(t) for t in trials)
    tally = ", ".join(f"{n} {k}" for k, n in kinds.items())
    failed = [f"trial {t.number} {t.user_attrs[RESULT]}" for t in trials if t.state.name == "FAIL"]
    if top := best(study):
        params = ", ".join(f"{k}={value_text(v)}" for k, v in top.params.items())
        return (
            f"search {study.study_name}: best {params}: {objective} {top.value:.4g} (trial "
            f"{top.number}; {len(trials)} trials: {tally})" + "".join(f"; {f}" for f in failed[:1])
        )
    advice = (
        f"{failed[0]}: fix that first"
        if failed
        else "no run reached trainer.target_acc: lower it or train longer"
        if kinds["missed"]
        else "lower the searched ranges' upper bounds ('lr.base=tag(log, interval(1e-4, 1e-2))')"
    )
    return (
        f"search {study.study_name}: no trial of {len(trials)} finished with a finite "
        f"{objective} ({tally}): no best setting; {advice}"
    )


def results(studies: list[optuna.Study]) -> dict[str, Any]:
    """optimization_results.yaml as hydra-optuna-sweeper writes it (best_params, best_value),
    per study under `studies` when there are several."""
    found = {}
    for study in studies:
        top = best(study)
        found[study.study_name] = {
            "best_params": {k: used(v) for k, v in top.params.items()} if top else None,
            "best_value": top.value if top else None,
        }
    return {"name": "optuna", **(found.popitem()[1] if len(found) == 1 else {"studies": found})}
