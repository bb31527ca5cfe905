"""`python -m amp_lab.report PATH... [--out DIR] [--ref RUN] [--wandb]`: compare runs side by side.

Reads each run's metrics.jsonl, summary.json and .hydra/overrides.yaml; prints a table (rich),
writes report.md and PNG plots to DIR (default: `<PATH>/report`), and with --wandb builds the same
comparison as a W&B Report. Runs that differ only in their seed are grouped (mean ± std).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from amp_lab.report.runs import (
    SEED_KEY,
    ReportError,
    RunData,
    differing_keys,
    group_label,
    group_runs,
    load_runs,
    mean_std,
)

COLUMNS = ["precision", "model", "final acc", "best acc", "Δacc vs ref", "steps→target",
           "time→target s", "samples/s", "speedup", "peak MB", "skipped", "status"]


def _f(value: Any, fmt: str = ".4g") -> str:
    return "—" if value is None else format(value, fmt)


def pick_reference(runs: list[RunData], ref: str | None) -> RunData | None:
    """--ref (a run directory or its name) if given, else the first completed fp32 run, else
    none: figures relative to a crashed or unfinished run would mislead."""
    if ref:
        for run in runs:
            names = (run.label, run.short_name().removeprefix("job "), run.path.name)
            if ref in names or Path(ref).resolve() == run.path.resolve():
                return run
        raise ReportError(f"--ref {ref} is not one of the runs; use a run directory's name, "
                          f"e.g. {runs[0].path.name}")
    return next((run for run in runs if run.precision == "fp32" and run.ok), None)


def _ref_values(runs: list[RunData], ref: RunData | None) -> tuple[float | None, float | None]:
    """Reference accuracy and samples/s: the mean over the reference's seed group."""
    if ref is None:
        return None, None
    group = [run for run in runs if run.group_key() == ref.group_key()]
    acc, _ = mean_std([run.summary.get("final_val_acc") for run in group])
    sps, _ = mean_std([run.summary.get("mean_samples_per_s") for run in group])
    return acc, sps


def run_rows(runs: list[RunData], ref: RunData | None) -> tuple[list[str], list[list[str]]]:
    """Header and one row per run: differing overrides, then the COLUMNS."""
    keys = [k for k in differing_keys(runs) if k not in ("precision", "model")]  # own columns
    ref_acc, ref_sps = _ref_values(runs, ref)
    rows = []
    for run in runs:
        s = run.summary
        acc, sps = s.get("final_val_acc"), s.get("mean_samples_per_s")
        delta = acc - ref_acc if acc is not None and ref_acc is not None else None
        speedup = sps / ref_sps if sps and ref_sps else None
        status = run.status if run.ok else f"**{run.status}**"  # bold (red in the terminal)
        found = [e["rule"] for e in s.get("health") or []]  # amp_lab/numerics/health.py
        status += f" (health: {', '.join(found)})" if found else ""
        rows.append([run.label + (" (ref)" if run is ref else ""),
                     *[run.overrides.get(k, "—") for k in keys],
                     run.precision, run.model, _f(acc), _f(s.get("best_val_acc")),
                     _f(delta, "+.4f"), _f(s.get("steps_to_target")),
                     _f(s.get("time_to_target_s"), ".1f"), _f(sps, ".1f"),
                     _f(speedup, ".2f") + ("×" if speedup else ""),
                     _f(s.get("peak_memory_mb"), ".0f"), _f(s.get("skipped_steps")), status])
    return ["run", *keys, *COLUMNS], rows


def group_rows(runs: list[RunData]) -> tuple[list[str], list[list[str]]] | None:
    """Header and one row per seed group (mean ± std), or None when no group has two runs."""
    groups = group_runs(runs)
    if all(len(members) < 2 for members in groups.values()):
        return None
    keys = differing_keys(runs)
    rows = []
    for members in groups.values():
        cells = [group_label(members, keys), str(len(members))]
        for key in ("final_val_acc", "best_val_acc", "mean_samples_per_s", "peak_memory_mb"):
            mean, std = mean_std([run.summary.get(key) for run in members])
            cells.append("—" if mean is None else f"{mean:.4g} ± {std:.2g}")
        rows.append(cells)
    header = ["group (without seed)", "runs", "final acc", "best acc", "samples/s", "peak MB"]
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def rich_table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title)
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        style = None if "**" not in row[-1] else "bold red"
        table.add_row(*[cell.replace("**", "") for cell in row], style=style)
    return table


def write_markdown(out: Path, runs: list[RunData], ref: RunData | None,
                   tables: list[tuple[list[str], list[list[str]]]], plots: list[Path]) -> Path:
    """report.md: the tables, then the plots."""
    ref_line = (f"Reference: `{ref.label}` ({ref.precision})" if ref else
                "No reference (no completed fp32 run; pass --ref RUN)")
    parts = [f"# amp_lab comparison: {len(runs)} runs", "", ref_line, "",
             "Sources: " + ", ".join(f"`{run.path}`" for run in runs), ""]
    parts += [markdown_table(*table) + "\n" for table in tables]
    parts += [f"![{plot.stem}]({os.path.relpath(plot, out)})" for plot in plots]
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path


def default_out(paths: list[Path]) -> Path:
    base = paths[0] if len(paths) == 1 else Path(os.path.commonpath([p.resolve() for p in paths]))
    return base / "report"


def make_report(paths: list[Path], out: Path | None = None, ref: str | None = None,
                wandb: bool = False, console: Console | None = None) -> Path:
    """Load the runs, print the table, write report.md and the plots; returns report.md."""
    from amp_lab.report.plots import write_plots

    if console is None:
        console = Console()
        if not console.is_terminal:
            console.width = 200  # logs and pipes: whole rows, not 80-column wrapping
    runs = load_runs(paths)
    reference = pick_reference(runs, ref)
    out = out or default_out(paths)
    out.mkdir(parents=True, exist_ok=True)
    tables = [run_rows(runs, reference)]
    tables += [g] if (g := group_rows(runs)) else []
    for (header, rows), title in zip(tables, ["runs", "seed groups"]):
        console.print(rich_table(f"amp_lab comparison: {title}", header, rows))
    plots = write_plots(runs, out, [k for k in differing_keys(runs) if k != SEED_KEY])
    report = write_markdown(out, runs, reference, tables, plots)
    console.print(f"report: {report}")
    if wandb:
        from amp_lab.report.wandb_report import publish

        publish(runs, out, markdown_table(*tables[0]), console)
    return report


def main(argv: list[str] | None = None) -> int:
    """The command line; exit code 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m amp_lab.report",
        description="Compare amp_lab runs side by side: a table, report.md and PNG plots.")
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                        help="multirun directories or run directories")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="output folder (default: <PATH>/report)")
    parser.add_argument("--ref", metavar="RUN",
                        help="reference run: its directory, its name or its sweep job number "
                             "(default: the fp32 run)")
    parser.add_argument("--wandb", action="store_true",
                        help="also build a W&B Report (offline: its spec as JSON)")
    args = parser.parse_args(argv)
    try:
        make_report(args.paths, args.out, args.ref, args.wandb)
    except ReportError as err:
        print(f"amp_lab.report: error: {err}", file=sys.stderr)
        return 2
    return 0

