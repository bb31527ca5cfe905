"""The benchmark's record: environment, exact command, results, as JSON and a markdown table."""

from __future__ import annotations

import json
import os
import platform
import shlex
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import timm
import torch

from amp_lab.checkpoint.run_dir import write_bytes_atomic
from amp_lab.tools.bench.flops import device_name
from amp_lab.tools.report.tables import markdown_table


def environment(device: torch.device, prog: str, argv: list[str]) -> dict[str, Any]:
    """Date, machine, versions and the exact command: what a reader needs to trust a figure."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([prog, *map(shlex.quote, argv)]),
        "device": device_name(device),
        "device_type": device.type,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],  # a shared machine skews CPU figures
        "python": platform.python_version(),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
    }


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.{digits}g}"  # nan too
    return str(value)


def section(
    heading: str, columns: str, rows: list[list[str]], notes: Sequence[str] = ()
) -> list[str]:
    """'## heading', a table of `columns` ('a | b | c') and `notes` under it; nothing without
    rows or notes."""
    if not (rows or notes):
        return []
    table = markdown_table(columns.split(" | "), rows)
    return [f"## {heading}", "", table, "", *notes] + ([""] if notes else [])


def write_report(
    out_dir: Path, env: dict[str, Any], results: dict[str, list[Any]], parts: Sequence[Any]
) -> None:
    """Write bench.json and bench.md atomically (a reader never sees half a file) from the lists
    each part reported so far; `parts`: the parts' modules, each writing its section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = "\n".join(
        [
            f"# amp_lab benchmark — {env['date']}",
            "",
            f"- device: {env['device']} ({env['device_type']}), torch {env['torch']}, "
            f"timm {env['timm']}, CUDA {env['cuda']}, Python {env['python']}",
            f"- CPU: {env['cpu_count']} cores, {env['torch_threads']} torch threads, "
            f"load average {env['load_average_1m']:.2f} at the start",
            f"- command: `{env['command']}`",
            "",
            *(line for part in parts for line in part.section(results)),
        ]
    )
    # dataclasses (a comparison's runs too) as their fields
    text = json.dumps({"environment": env, **results}, indent=2, default=asdict)
    write_bytes_atomic(out_dir / "bench.json", text.encode())
    write_bytes_atomic(out_dir / "bench.md", markdown.encode())
