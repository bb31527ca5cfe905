"""The comparison as data (`report.json`): axis, groups, references, cells, deltas, verdicts,
runs and context. report.md, the terminal tables, the plots and the W&B Report are views of it."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from amp_lab.command import strict_json
from amp_lab.tools.report.context import gather, run_device
from amp_lab.tools.report.figures import compare, figures
from amp_lab.tools.report.groups import Group, axis_keys, make_groups, set_references
from amp_lab.tools.report.runs import RunData
from amp_lab.tools.report.verdicts import (
    THRESHOLDS,
    group_verdict,
    health,
    merged_health,
    rules_text,
)


def _status(runs: list[RunData]) -> str:
    """The cell's status: `completed`, one run's own, else each with its count over the seeds
    (`1× incomplete: no summary.json, 1× completed`)."""
    counts = Counter(run.status for run in runs)
    if len(counts) == 1 and (len(runs) == 1 or "completed" in counts):
        return next(iter(counts))
    return ", ".join(f"{n}× {s}" for s, n in counts.items())


def _group_data(index: int, group: Group, speed_ok: bool) -> dict[str, Any]:
    ref = group.reference
    comps = {cell.value: compare(cell, ref, THRESHOLDS) for cell in group.cells}
    cells = [
        {
            "value": cell.value,
            "reference": cell is ref,
            "runs": [run.label for run in cell.runs],
            "seeds": [run.seed for run in cell.runs],
            "n": len(cell.runs),
            "status": _status(cell.runs),
            "health": merged_health(cell.runs),
            "figures": {k: asdict(s) for k, s in figures(cell.runs).items()},
            "delta": comps[cell.value].as_dict(),
        }
        for cell in group.cells
    ]
    return {
        "id": index,
        "name": group.name,
        "settings": group.settings,
        "reference": ref.value if ref else None,
        "reference_note": group.reference_note,
        "verdict": group_verdict(group, comps, speed_ok),
        "cells": cells,
    }


def build(runs: list[RunData], by: str, ref: str | None, argv: list[str]) -> dict[str, Any]:
    """Everything the report says, as plain data; `argv`: the report's command line."""
    groups = make_groups(runs, by)
    set_references(groups, by, ref)
    context = gather(runs, argv)
    speed_ok = bool(context["speed_representative"])
    rows = {
        run.label: {
            "label": run.label,
            "path": str(run.path),
            "group": i,
            "value": cell.value,
            "seed": run.seed,
            "status": run.status,
            "device": run_device(run),
            "health": health(run),
            "final_val_acc": run.summary.get("final_val_acc"),
            "final_val_loss": run.summary.get("final_val_loss"),
        }
        for i, group in enumerate(groups, 1)
        for cell in group.cells
        for run in cell.runs
    }
    return strict_json(
        {
            "axis": by,
            "axis_keys": axis_keys(runs, by),
            "thresholds": asdict(THRESHOLDS),
            "rules": rules_text(),
            "groups": [_group_data(i, g, speed_ok) for i, g in enumerate(groups, 1)],
            "runs": [rows[run.label] for run in runs],
            "context": context,
        }
    )
