"""`amp_lab report SWEEP` on a search: per study (one per precision) the best LR and warmup with
the trial count, each mode's best LR against fp32's, the loss-vs-LR curve and the LR
sensitivity: the LR range of the trials within 1% of the study's best loss.

The studies' journal (search.journal) says which trials finished and how; each trial's run
folder says what it ran (its lr.base, warmup, precision), as for any run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from amp_lab.records import SEARCH_FILE
from amp_lab.report.context import gather
from amp_lab.report.context import markdown as context_markdown
from amp_lab.report.runs import ReportError, RunData, load_run
from amp_lab.report.tables import markdown_table
from amp_lab.search.study import AXIS, JOB_DIR, RESULT, finished, storage, verdict

NEAR_BEST = 0.01  # the sensitivity band: trials whose loss is within 1% of the best
REFERENCE = "fp32"  # each mode's best LR is told as a ratio to this mode's
HEADER = ["study", "trials", "best lr.base", "warmup", "val loss", "× fp32 LR", "LR within 1%"]


def is_search(paths: list[Path]) -> bool:
    """One sweep folder that holds a search's journal."""
    return len(paths) == 1 and (paths[0] / SEARCH_FILE).is_file()


def _setting(settings: dict[str, str], key: str) -> Any:
    return json.loads(settings[key]) if key in settings else None


def _row(run: RunData, trial: Any) -> dict[str, Any]:
    return {
        "trial": trial.number,
        "state": trial.state.name,
        "result": trial.user_attrs[RESULT],
        "val_loss": trial.value,
        "lr": _setting(run.settings, "lr.base"),
        "warmup_steps": _setting(run.settings, "lr.warmup_steps"),
        "precision": run.precision,
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
    best = min(done, key=lambda r: r["val_loss"], default=None)
    near = [r["lr"] for r in done if best and r["val_loss"] <= best["val_loss"] * (1 + NEAR_BEST)]
    return {
        "study": study.study_name,
        "axis": study.user_attrs.get(AXIS, []),
        "precision": rows[0]["precision"] if rows else None,
        "trials": len(rows),
        "completed": len(done),
        "diverged": sum(r["result"].startswith("diverged") for r in rows),
        "pruned": sum(r["state"] == "PRUNED" for r in rows),
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
    counts = f"{s['trials']} ({s['completed']} ok, {s['pruned']} pruned, {s['diverged']} diverged)"
    if best is None:
        return [s["study"], counts, "-", "-", "-", "-", "-"]
    width = (
        f"{band[0]:.3g}-{band[1]:.3g} (×{band[1] / band[0]:.2g}, {s['near_best_trials']} trials)"
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
    table = Table(title=f"search {data['sweep_dir']}")
    for name in HEADER:
        table.add_column(name)
    for s in data["studies"]:
        table.add_row(*_cells(s))
    console.print(table)
    for s in data["studies"]:
        console.print(s["verdict"])


def _draw(ax: Any, study: dict[str, Any], color: str) -> None:
    """One study: a line through its completed trials, a star at its best, a ring at each
    pruned trial's last reported loss, an x at the top edge for each failed trial."""
    rows = sorted(study["rows"], key=lambda r: r["lr"])
    done = [r for r in rows if r["state"] == "COMPLETE"]
    label = f"{study['study']} ({study['trials']} trials)"
    xs, ys = [r["lr"] for r in done], [r["val_loss"] for r in done]
    ax.plot(xs, ys, "o-", color=color, label=label, markersize=4)
    if study["best"]:
        ax.plot(study["best"]["lr"], study["best"]["val_loss"], "*", color=color, markersize=14)
    pruned = [r for r in rows if r["state"] == "PRUNED" and r["last_reported"] is not None]
    xs, ys = [r["lr"] for r in pruned], [r["last_reported"] for r in pruned]
    ax.plot(xs, ys, "o", mfc="none", color=color)
    failed = [r["lr"] for r in rows if r["state"] == "FAIL"]
    top = ax.get_xaxis_transform()  # x in data, y in axes fractions: 0.97 is the top edge
    ax.plot(failed, [0.97] * len(failed), "x", color=color, ms=10, mew=2, transform=top)


def plot(data: dict[str, Any], path: Path) -> Path:
    """search.png: final val loss against lr.base (log scale), one colour per study."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, study in enumerate(data["studies"]):
        _draw(ax, study, colors[i % len(colors)])
    title = "loss against LR per study (x at the top: failed or diverged; ring: pruned)"
    ax.set(xscale="log", xlabel="lr.base", ylabel="final val loss", title=title)
    ax.legend(loc="best", fontsize="small")  # inside the axes: the figure keeps its width
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_search_report(
    sweep_dir: Path, out: Path, console: Console, readme: Path | None, argv: list[str]
) -> Path:
    """Read the search, print it, write report.json, report.md and search.png into `out`."""
    from amp_lab.report.readme import write_block

    data = search_data(sweep_dir, argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    picture = plot(data, out / "search.png")
    print_search(console, data)
    report = out / "report.md"
    report.write_text(f"# amp_lab search: {sweep_dir}\n\n{markdown(data, picture.name)}\n")
    console.print(f"report: {report}")
    if readme is not None:
        write_block(readme, markdown(data, os.path.relpath(picture, readme.parent)))
        console.print(f"findings written into {readme}")
    return report
