"""`python -m amp_lab.report PATH... [--by KEY] [--ref RUN|VALUE] [--out DIR] [--wandb]`.

Compares runs along one axis (`precision` unless `--by KEY`), group by group: runs equal in every
other setting, seeds aside, against their own reference (see amp_lab.report.groups). Prints the
tables and verdicts (rich), writes report.json, report.md and overview.png to DIR (default:
`<PATH>/report`), and with --wandb the same comparison as a W&B Report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from amp_lab.report.context import markdown as context_markdown
from amp_lab.report.document import build
from amp_lab.report.groups import DEFAULT_AXIS
from amp_lab.report.runs import ReportError, load_runs

REPORT_JSON = "report.json"
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


def shown_columns(data: dict[str, Any]) -> list[int]:
    """Indexes of COLUMNS to show: a per-rank memory column only when some run reports it
    (runs written before amp_lab recorded it leave it unknown everywhere)."""
    known = {
        key
        for group in data["groups"]
        for cell in group["cells"]
        for key in PER_RANK_BYTES
        if cell["figures"].get(key, UNKNOWN)["mean"] is not None
    }
    first = COLUMNS.index("params MB")
    hidden = {first + i for i, key in enumerate(PER_RANK_BYTES) if key not in known}
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


def default_out(paths: list[Path]) -> Path:
    base = paths[0] if len(paths) == 1 else Path(os.path.commonpath([p.resolve() for p in paths]))
    return base / "report"


def make_report(
    paths: list[Path],
    out: Path | None = None,
    ref: str | None = None,
    by: str = DEFAULT_AXIS,
    wandb: bool = False,
    console: Console | None = None,
    argv: list[str] | None = None,
    readme: Path | None = None,
) -> Path:
    """Load the runs, compare them, print and write the report; returns report.md."""
    from amp_lab.report.plots import write_plots

    if console is None:
        console = Console()
        if not console.is_terminal:
            console.width = 200  # logs and pipes: whole rows, not 80-column wrapping
    if readme is not None and not readme.is_file():
        raise ReportError(f"--readme {readme} is not a file; pass an existing markdown file")
    runs = load_runs(paths)
    data = build(runs, by, ref, argv if argv is not None else [str(p) for p in paths])
    out = out or default_out(paths)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_JSON).write_text(json.dumps(data, indent=1) + "\n")
    print_tables(console, data)
    plots = write_plots(runs, data, out)
    report = write_markdown(out, data, plots)
    console.print(f"report: {report}")
    if readme is not None:
        from amp_lab.report.readme import update_readme

        update_readme(readme, data, plots[0])
        console.print(f"findings written into {readme}")
    if wandb:
        from amp_lab.report.wandb_report import publish

        publish(runs, data, out, console)
    return report


def main(argv: list[str] | None = None) -> int:
    """The command line; exit code 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m amp_lab.report",
        description="Compare amp_lab runs group by group along one axis: tables, verdicts, "
        "report.json, report.md and plots.",
    )
    parser.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="multirun directories or run directories",
    )
    parser.add_argument(
        "--by",
        default=DEFAULT_AXIS,
        metavar="KEY",
        help="the axis compared: a settings group or key, e.g. "
        "scaler.init_scale (default: precision)",
    )
    parser.add_argument(
        "--ref",
        metavar="RUN|VALUE",
        help="each group's reference: a value on the axis (e.g. 65536), or a "
        "run's label or directory (default: fp32, or the key's default)",
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="output folder (default: <PATH>/report)"
    )
    parser.add_argument(
        "--wandb", action="store_true", help="also build a W&B Report (offline: its spec as JSON)"
    )
    parser.add_argument(
        "--readme",
        type=Path,
        metavar="FILE",
        help="also write the verdicts, tables and overview into FILE, between "
        "its amp_lab.report markers (a study's README)",
    )
    args = parser.parse_args(argv)
    try:
        make_report(
            args.paths,
            args.out,
            args.ref,
            args.by,
            args.wandb,
            argv=sys.argv[1:] if argv is None else argv,
            readme=args.readme,
        )
    except ReportError as err:
        print(f"amp_lab.report: error: {err}", file=sys.stderr)
        return 2
    return 0
