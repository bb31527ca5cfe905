"""The comparison's tables: one row per cell, as markdown (report.md, a study's README) and as
rich tables on the terminal, each group under its verdict."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from amp_lab.report.context import markdown as context_markdown

UNKNOWN = {"mean": None, "std": None, "n": 0}  # a figure a report.json of an older version lacks
COLUMNS = [
    "n",
    "runs",
    "final acc %",
    "best acc %",
    "val loss",
    "Δacc pp",
    "Δloss",
    "steps→target",
    "time→target s",
    "samples/s",
    "speed-up",
    "low-precision FLOPs %",
    "peak MB",
    "params MB",
    "grads MB",
    "state MB",
    "skipped",
    "loss scale",
    "status",
]


# this rank's bytes of parameters, gradients and optimizer state (FSDP: its shards; summary.json)
PER_RANK_BYTES = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


# the figure of each column that runs of an older amp_lab lack
OPTIONAL = {
    "params MB": "param_bytes",
    "grads MB": "grad_bytes",
    "state MB": "optimizer_state_bytes",
    "low-precision FLOPs %": "low_precision_share",  # the precision audit's
}


def shown_columns(data: dict[str, Any]) -> list[int]:
    """Indexes of COLUMNS to show: a per-rank memory or audit column only when some run reports
    it (runs written before amp_lab recorded it leave it unknown everywhere)."""
    known = {
        key
        for group in data["groups"]
        for cell in group["cells"]
        for key in OPTIONAL.values()
        if cell["figures"].get(key, UNKNOWN)["mean"] is not None
    }
    hidden = {COLUMNS.index(column) for column, key in OPTIONAL.items() if key not in known}
    return [i for i in range(len(COLUMNS)) if i not in hidden]


def _num(stat: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
    """`mean ± std` (std only over several runs), `—` when unknown."""
    if stat["mean"] is None:
        return "—"
    text = format(stat["mean"] * scale, fmt)
    if stat["n"] > 1 and stat["std"] is not None:
        text += " ± " + format(stat["std"] * scale, fmt.lstrip("+"))
    return text


def _scale(stat: dict[str, Any]) -> str:
    """A loss scale as a power of two (`2^16`) when it is one, as the scaler keeps it."""
    mean = stat["mean"]
    if mean == 1.0 and not stat["std"]:
        return "1"  # not scaled
    if mean is not None and mean > 0 and math.log2(mean).is_integer() and not stat["std"]:
        return f"2^{int(math.log2(mean))}"
    return _num(stat, ".4g")


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def cell_row(cell: dict[str, Any]) -> list[str]:
    """One table row: the axis value (ref marked), then COLUMNS."""
    f, d = cell["figures"], cell["delta"]
    status = cell["status"] if not cell["health"] else "; ".join(cell["health"])
    return [
        cell["value"] + (" (ref)" if cell["reference"] else ""),
        str(cell["n"]),
        ", ".join(cell["runs"]),
        _num(f["final_val_acc"], ".1f", 100),
        _num(f["best_val_acc"], ".1f", 100),
        _num(f["final_val_loss"], ".4f"),
        _num(d["acc"], "+.1f", 100),
        _num(d["loss"], "+.3g"),
        _num(f["steps_to_target"], ".0f"),
        _num(f["time_to_target_s"], ".1f"),
        _num(f["mean_samples_per_s"], ".1f"),
        _ratio(d["speedup"]),
        _num(f.get("low_precision_share", UNKNOWN), ".1f", 100),
        _num(f["peak_memory_mb"], ".0f"),
        *(_num(f.get(key, UNKNOWN), ".2f", 1e-6) for key in PER_RANK_BYTES),  # bytes -> MB
        _num(f["skipped_steps"], ".0f"),
        _scale(f["final_loss_scale"]),
        status if status == "completed" else f"**{status}**",
    ]


def _pick(row: list[str], shown: list[int]) -> list[str]:
    """The axis cell, then the shown COLUMNS of a cell_row."""
    return [row[0], *(row[1 + i] for i in shown)]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def group_sections(data: dict[str, Any], level: str = "##") -> list[str]:
    """Per group: a heading, its verdict and its table (markdown lines)."""
    parts, shown = [], shown_columns(data)
    for group in data["groups"]:
        parts += [
            f"{level} Group {group['id']}: {group['name']}",
            "",
            f"**Verdict:** {group['verdict']}",
            "",
            markdown_table(
                [data["axis"], *(COLUMNS[i] for i in shown)],
                [_pick(cell_row(c), shown) for c in group["cells"]],
            ),
            "",
        ]
    return parts


def write_markdown(out: Path, data: dict[str, Any], plots: list[Path]) -> Path:
    """report.md: context, rules, then per group its verdict and table, then the plots."""
    n = len(data["groups"])
    parts = [
        f"# amp_lab comparison: {len(data['runs'])} runs in {n} group{'s' * (n != 1)} "
        f"along `{data['axis']}`",
        "",
        context_markdown(data["context"]),
        "",
        data["rules"],
        "",
        *group_sections(data),
    ]
    flagged = [r for r in data["runs"] if r["health"]]
    if flagged:
        parts += ["## Run health", ""]
        parts += [f"- `{r['label']}`: " + "; ".join(r["health"]) for r in flagged]
        parts.append("")
    parts += [f"![{plot.stem}]({os.path.relpath(plot, out)})" for plot in plots]
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path


def print_tables(console: Console, data: dict[str, Any]) -> None:
    """The groups as rich tables, each with its verdict under it."""
    shown = shown_columns(data)
    for group in data["groups"]:
        table = Table(title=f"group {group['id']}: {group['name']}")
        for name in [data["axis"], *(COLUMNS[i] for i in shown)]:
            table.add_column(name, overflow="fold")
        for cell in group["cells"]:
            row = _pick(cell_row(cell), shown)
            table.add_row(
                *[c.replace("**", "") for c in row],
                style=None if "**" not in row[-1] else "bold red",
            )
        console.print(table)
        console.print(f"verdict: {group['verdict']}")
    if not data["context"]["speed_representative"]:
        console.print(f"speed not representative: {data['context']['speed_note']}")
