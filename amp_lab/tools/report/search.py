"""`amp_lab report SWEEP` on a search: per study the best LR and warmup, each mode's best LR
against fp32's, the loss-vs-LR curve and the LR range within 1% of the best loss. The journal
says which trials finished and how; each trial's run folder what it ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from amp_lab.records import SEARCH_FILE
from amp_lab.search.study import AXIS, JOB_DIR, RESULT, finished, kind, storage, verdict
from amp_lab.tools.report.context import gather
from amp_lab.tools.report.context import markdown as context_markdown
from amp_lab.tools.report.runs import ReportError, RunData, load_run, setting_value
from amp_lab.tools.report.tables import markdown_table, rich_table

NEAR_BEST = 0.01  # the sensitivity band: trials whose loss is within 1% of the best
REFERENCE = "fp32"  # each mode's best LR is told as a ratio to this mode's
HEADER = ["study", "trials", "best lr.base", "warmup", "val loss", "× fp32 LR", "LR within 1%"]


def is_search(paths: list[Path]) -> bool:
    """One sweep folder that holds a search's journal."""
    return len(paths) == 1 and (paths[0] / SEARCH_FILE).is_file()


def _row(run: RunData, trial: Any) -> dict[str, Any]:
    return {
        "trial": trial.number,
        "state": trial.state.name,
        "result": trial.user_attrs[RESULT],
        "kind": kind(trial),  # completed, pruned, diverged, missed, crashed or refused
        "val_loss": trial.value,  # the objective's value (final_val_loss unless it says other)
        "lr": setting_value(run.settings.get("lr.base")),
        "warmup_steps": setting_value(run.settings.get("lr.warmup_steps")),
        "precision": setting_value(run.settings.get("precision.name")),
        "job_dir": trial.user_attrs[JOB_DIR],
        # a pruned trial's last reported val loss, where the curve could not take it further
        "last_reported": trial.intermediate_values[max(trial.intermediate_values)]
        if trial.intermediate_values
        else None,
    }


def _study(study: Any, sweep_dir: Path, runs: list[RunData]) -> dict[str, Any]:
    """A study's figures; its trials' runs are added to `runs`."""
    trials = finished(study)
    runs += [load_run(sweep_dir / t.user_attrs[JOB_DIR]) for t in trials]
    rows = [_row(run, t) for run, t in zip(runs[-len(trials) :], trials)] if trials else []
    done = [r for r in rows if r["state"] == "COMPLETE"]
    precisions = {r["precision"] for r in rows}  # one, unless the study searched precision
    sign = 1 if study.direction.name == "MINIMIZE" else -1  # an accuracy objective: the most
    best = min(done, key=lambda r: sign * r["val_loss"], default=None)
    band = abs(best["val_loss"]) * NEAR_BEST if best else 0
    near = [r["lr"] for r in done if best and sign * (r["val_loss"] - best["val_loss"]) <= band]
    return {
        "study": study.study_name,
        "axis": study.user_attrs.get(AXIS, []),
        "precision": precisions.pop() if len(precisions) == 1 else None,
        "trials": len(rows),
        "completed": len(done),
        "diverged": sum(r["kind"] == "diverged" for r in rows),
        "pruned": sum(r["kind"] == "pruned" for r in rows),
        "crashed": sum(r["state"] == "FAIL" for r in rows),  # or refused
        "best": best,
        "near_best_lr": [min(near), max(near)] if near else None,
        "near_best_trials": len(near),
        "verdict": verdict(study),
        "rows": rows,
    }


def _others(study: dict[str, Any]) -> tuple[str, ...]:
    """The study's sweep values other than its precision (e.g. its model)."""
    return tuple(o for o in study["axis"] if not o.startswith("precision="))


def _ratios(studies: list[dict[str, Any]]) -> None:
    """Each study's best LR over that of the fp32 study with the same other sweep values (the
    same model), with the range the two 1% bands allow (the noise)."""
    refs = {_others(s): s for s in studies if s["precision"] == REFERENCE and s["best"]}
    for s in studies:
        s["lr_ratio"] = s["lr_ratio_range"] = None
        if (ref := refs.get(_others(s))) and s["best"]:
            (lo, hi), (ref_lo, ref_hi) = s["near_best_lr"], ref["near_best_lr"]
            s["lr_ratio"] = s["best"]["lr"] / ref["best"]["lr"]
            s["lr_ratio_range"] = [lo / ref_hi, hi / ref_lo]


def search_data(sweep_dir: Path, argv: list[str]) -> dict[str, Any]:
    """report.json of a search; `argv`: the report's command line, for its context."""
    import optuna

    journal = storage(sweep_dir)
    names = optuna.get_all_study_names(journal)
    if not names:
        raise ReportError(f"{sweep_dir / SEARCH_FILE} holds no study; run the search first")
    runs: list[RunData] = []
    studies = [
        _study(optuna.load_study(study_name=n, storage=journal), sweep_dir, runs) for n in names
    ]
    _ratios(studies)
    return {
        "kind": "search",
        "sweep_dir": str(sweep_dir),
        "context": gather(runs, argv),
        "near_best": NEAR_BEST,
        "studies": studies,
    }


def _cells(s: dict[str, Any]) -> list[str]:
    best, band, ratio = s["best"], s["near_best_lr"], s["lr_ratio"]
    crashed = f", {s['crashed']} crashed" if s.get("crashed") else ""
    counts = (
        f"{s['trials']} ({s['completed']} ok, {s['pruned']} pruned, {s['diverged']} diverged"
        f"{crashed})"
    )
    if best is None:
        return [s["study"], counts, "-", "-", "-", "-", "-"]
    near = s["near_best_trials"]
    width = (
        f"{band[0]:.3g}-{band[1]:.3g} (×{band[1] / band[0]:.2g}, {near} trial{'s' * (near != 1)})"
    )
    within = f" ({s['lr_ratio_range'][0]:.2f}-{s['lr_ratio_range'][1]:.2f})" if ratio else ""
    return [
        s["study"],
        counts,
        f"{best['lr']:.3g}",
        str(best["warmup_steps"]),
        f"{best['val_loss']:.4f}",
        f"{ratio:.2f}{within}" if ratio is not None else "-",
        width,
    ]


def markdown(data: dict[str, Any], picture: str) -> str:
    """The verdicts, the table and the curve, as markdown."""
    return "\n".join(
        [
            context_markdown(data["context"]),
            "",
            *(f"- {s['verdict']}" for s in data["studies"]),
            "",
            markdown_table(HEADER, [_cells(s) for s in data["studies"]]),
            "",
            f"`× fp32 LR`: the best LR over fp32's best, in brackets the range the trials within "
            f"{100 * NEAR_BEST:g}% of each best loss allow; `LR within 1%`: that LR range (the "
            "sensitivity: a wide range is a forgiving mode).",
            "",
            f"![loss against LR per precision]({picture})",
        ]
    )


def print_search(console: Console, data: dict[str, Any]) -> None:
    """The studies as a rich table, then their verdicts."""
    rows = [_cells(s) for s in data["studies"]]
    console.print(rich_table(f"search {data['sweep_dir']}", HEADER, rows))
    for s in data["studies"]:
        console.print(s["verdict"])
