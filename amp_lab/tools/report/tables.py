"""The comparison's tables: one row per cell as markdown (report.md, a study's README), one
column per cell as rich tables on the terminal, each group under its verdict."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from amp_lab.tools.report.context import markdown as context_markdown

START, END = "<!-- amp_lab.report:start -->", "<!-- amp_lab.report:end -->"
UNKNOWN = {"mean": None, "std": None, "n": 0}  # a figure a report.json of an older version lacks
Cell = dict[str, Any]


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


def _status(cell: Cell) -> str:
    status = cell["status"] if not cell["health"] else "; ".join(cell["health"])
    return status if status == "completed" else f"**{status}**"


def _figure(key: str, fmt: str, scale: float = 1.0) -> Callable[[Cell], str]:
    return lambda cell: _num(cell["figures"].get(key, UNKNOWN), fmt, scale)


# each column after the axis value: its header and how a cell (report.json) fills it
COLUMNS: dict[str, Callable[[Cell], str]] = {
    "n": lambda cell: str(cell["n"]),
    "runs": lambda cell: ", ".join(cell["runs"]),
    "final acc %": _figure("final_val_acc", ".1f", 100),
    "best acc %": _figure("best_val_acc", ".1f", 100),
    "val loss": _figure("final_val_loss", ".4f"),
    "Δacc pp": lambda cell: _num(cell["delta"]["acc"], "+.1f", 100),
    "Δloss": lambda cell: _num(cell["delta"]["loss"], "+.3g"),
    "steps→target": _figure("steps_to_target", ".0f"),
    "time→target s": _figure("time_to_target_s", ".1f"),
    "samples/s": _figure("mean_samples_per_s", ".1f"),
    "speed-up": lambda cell: "—" if (x := cell["delta"]["speedup"]) is None else f"{x:.2f}×",
    "low-precision FLOPs %": _figure("low_precision_share", ".1f", 100),
    "peak MB": _figure("peak_memory_mb", ".0f"),
    # this rank's bytes of parameters, gradients and optimizer state (FSDP: its shards), in MB
    "params MB": _figure("param_bytes", ".2f", 1e-6),
    "grads MB": _figure("grad_bytes", ".2f", 1e-6),
    "state MB": _figure("optimizer_state_bytes", ".2f", 1e-6),
    "skipped": _figure("skipped_steps", ".0f"),
    "loss scale": lambda cell: _scale(cell["figures"]["final_loss_scale"]),
    "status": _status,
}
# the columns of figures that runs of an older amp_lab lack (per-rank bytes, the precision audit)
OPTIONAL = ("low-precision FLOPs %", "params MB", "grads MB", "state MB")


def _table(data: dict[str, Any], group: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """A group's header and rows, an OPTIONAL column only where some cell reports it."""
    cells = [cell for g in data["groups"] for cell in g["cells"]]
    shown = [
        name
        for name in COLUMNS
        if name not in OPTIONAL or any(COLUMNS[name](cell) != "—" for cell in cells)
    ]
    rows = [
        [cell["value"] + (" (ref)" if cell["reference"] else "")]
        + [COLUMNS[name](cell) for name in shown]
        for cell in group["cells"]
    ]
    return [data["axis"], *shown], rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _sections(data: dict[str, Any], level: str) -> list[str]:
    """The context and the rules, then per group a heading, its verdict and its table."""
    parts = [context_markdown(data["context"]), "", data["rules"], ""]
    for group in data["groups"]:
        parts += [
            f"{level} Group {group['id']}: {group['name']}",
            "",
            f"**Verdict:** {group['verdict']}",
            "",
            markdown_table(*_table(data, group)),
            "",
        ]
    return parts


def report_markdown(data: dict[str, Any], picture: str) -> str:
    """report.md: context, rules, then per group its verdict and table, then the overview."""
    n = len(data["groups"])
    parts = [
        f"# amp_lab comparison: {len(data['runs'])} runs in {n} group{'s' * (n != 1)} "
        f"along `{data['axis']}`",
        "",
        *_sections(data, "##"),
    ]
    flagged = [r for r in data["runs"] if r["health"]]
    if flagged:
        parts += ["## Run health", ""]
        parts += [f"- `{r['label']}`: " + "; ".join(r["health"]) for r in flagged]
        parts.append("")
    parts.append(f"![overview]({picture})")
    return "\n".join(parts)


def findings(data: dict[str, Any], picture: str) -> str:
    """The commands, the context, the rules, each group's verdict and table, the overview."""
    return "\n".join([*_sections(data, "####"), f"![overview of the report]({picture})"])


def write_block(readme: Path, body: str) -> None:
    """Replace what lies between the markers of `readme` with `body` (appended with markers
    when it has none); the author's text around them stays."""
    text = readme.read_text()
    block = f"{START}\n{body}\n{END}"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    readme.write_text(text)


NAME_WIDTH = 16  # a column's name up to this stays whole; a longer one (a run's) folds


def rich_table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    """A markdown table turned, one column per row (a cell, a study), so that a few fit an
    80-column terminal where twenty figures side by side do not; trouble (bold) in bold red."""
    axis = "\n".join(header[0].split(","))  # an axis of several keys: a line each
    table = Table(
        Column(axis, no_wrap=True),
        *(Column(row[0], overflow="fold", min_width=min(len(row[0]), NAME_WIDTH)) for row in rows),
        title=title,
    )
    for i, name in enumerate(header[1:], 1):
        table.add_row(
            name,
            *(Text(r[i].replace("**", ""), style="bold red" if "**" in r[i] else "") for r in rows),
        )
    return table


def _parts_that_fit(header: list[str], rows: list[list[str]], width: int) -> list[list[list[str]]]:
    """The rows in runs whose tables fit `width` columns, the names' column beside each: rich
    crops a wider table, and the cells past the edge are lost (three labels of several keys)."""
    names = max(len(line) for line in [*header[0].split(","), *header[1:]])
    runs: list[list[list[str]]] = []
    used = width
    for row in rows:
        need = min(len(row[0]), NAME_WIDTH) + 3  # the column, its padding and its rule
        if not runs or used + need > width:
            runs.append([])
            used = names + 4  # the names' column and the table's outer rules
        runs[-1].append(row)
        used += need
    return runs


def print_tables(console: Console, data: dict[str, Any]) -> None:
    """The groups as rich tables (several where one is too wide), each over its verdict."""
    for group in data["groups"]:
        header, rows = _table(data, group)
        title = f"group {group['id']}: {group['name']}"
        for part in _parts_that_fit(header, rows, console.width):
            console.print(rich_table(title, header, part))
            title = f"group {group['id']}, continued"
        console.print(f"verdict: {group['verdict']}")
    if not data["context"]["speed_representative"]:
        console.print(f"speed not representative: {data['context']['speed_note']}")
