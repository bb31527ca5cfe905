"""The benchmark's record: environment, exact command, results, as JSON and a markdown table."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import timm
import torch

from amp_lab.checkpoint.run_dir import write_bytes_atomic
from amp_lab.tools.bench.compile_cache import CompileRecord
from amp_lab.tools.bench.feed import FeedRow
from amp_lab.tools.bench.flops import device_name
from amp_lab.tools.bench.overhead import OverheadResult
from amp_lab.tools.bench.peer import PeerComparison
from amp_lab.tools.bench.throughput import ThroughputRow
from amp_lab.tools.report.tables import markdown_table

# bench.json's result lists, in its order; each part's runner replaces its own as it measures
RESULTS = ("compile_cache", "overhead", "throughput", "throughput_errors", "feed", "peer")


def environment(device: torch.device, argv: list[str]) -> dict[str, Any]:
    """Date, machine, versions and the exact command: what a reader needs to trust a figure."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m amp_lab bench", *map(shlex.quote, argv)]),
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


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.{digits}g}"  # nan too
    return str(value)


def _section(
    heading: str, columns: str, rows: list[list[str]], notes: Sequence[str] = ()
) -> list[str]:
    """'## heading', a table of `columns` ('a | b | c') and `notes` under it; nothing without
    rows or notes."""
    if not (rows or notes):
        return []
    table = markdown_table(columns.split(" | "), rows)
    return [f"## {heading}", "", table, "", *notes] + ([""] if notes else [])


def compile_cache_section(records: list[CompileRecord]) -> list[str]:
    rows = [
        [
            r.model,
            r.precision,
            f"{r.first_step_s:.1f}" if r.first_step_s is not None else f"failed: {r.error}",
        ]
        for r in records
    ]
    return _section(
        "torch.compile caches filled (each configuration's first step, with compilation, run in "
        "parallel processes)",
        "model | precision | first step s",
        rows,
    )


def overhead_section(results: list[OverheadResult]) -> list[str]:
    rows = [
        [r.model, r.variant, r.precision, f"{statistics.median(r.amp_lab_ms):.2f}"]
        + [f"{statistics.median(r.bare_ms):.2f}", f"**{r.median_ratio:.3f}**"]
        + [f"{x:.3f}" for x in (min(r.ratios), max(r.ratios), r.median_cpu_ratio)]
        + [str(len(r.ratios)), ", ".join(f"{m:.3f}" for m in r.run_medians)]
        for r in results
    ]
    return _section(
        "Overhead: amp_lab step / bare loop (median of rounds; wall time, and process CPU time)",
        "model | variant | precision | amp_lab ms/step | bare ms/step | median ratio | min | "
        "max | CPU-time ratio | rounds | runs' median ratios",
        rows,
    )


def throughput_section(rows: list[ThroughputRow], errors: list[dict[str, Any]]) -> list[str]:
    cells = [
        [r.model, r.precision, _fmt(r.compile), _fmt(r.channels_last), str(r.batch_size)]
        + [_fmt(r.first_step_s), f"{r.samples_per_s:.1f}"]
        + [f"{ms:.2f}" for ms in (r.step_ms, r.forward_ms, r.backward_ms, r.optimizer_ms)]
        + [f"{r.peak_memory_mb:.0f}", r.state_dtype, f"{r.state_mb:.2f}"]
        + [_fmt(r.achieved_tflops), f"{100 * r.mfu:.1f}%" if r.mfu is not None else "—"]
        + [f"{r.speedup_vs_fp32:.2f}×" if r.speedup_vs_fp32 is not None else "—"]
        + [f"{r.fp8_linears} ({r.fp8_recipe})" if r.fp8_recipe else "—"]
        for r in rows
    ]
    cells += [
        [e["model"], e["precision"], _fmt(e["compile"]), f"failed: {e['error']}"] + [""] * 14
        for e in errors
    ]
    return _section(
        "Throughput",
        "model | precision | compile | channels_last | batch | first step s | samples/s | "
        "step ms | fwd ms | bwd ms | opt ms | peak MB | state | state MB | TFLOP/s | MFU | "
        "vs fp32 | fp8 Linears",
        cells,
    )


def feed_section(rows: list[FeedRow]) -> list[str]:
    cells = [
        [r.model, r.precision, r.data, str(r.workers), f"{r.samples_per_s:.1f}"]
        + [_fmt(r.data_share, 2), _fmt(r.vs_synthetic)]
        for r in rows
    ]
    return _section(
        "Feed: synthetic data vs JPEG files decoded on the host and on the device "
        "(samples/s after warm-up; data share: time waiting for batches)",
        "model | precision | data | workers | samples/s | data share | vs synthetic",
        cells,
    )


def peer_section(comparisons: list[PeerComparison]) -> list[str]:
    rows = [  # a comparison without a ratio yet is the first round's peer run alone
        [c.model, c.precision, str(c.batch_size), str(c.img_size), str(c.epochs)]
        + [str(len(c.ratios)), f"{c.median('amp_lab', 'samples_per_s'):.1f}"]
        + [f"{c.median('peer', 'samples_per_s'):.1f}"]
        + [f"**{c.ratio:.3f}** ({min(c.ratios):.2f}–{max(c.ratios):.2f})"]
        + [f"{c.median(p, 'wall_s'):.1f}" for p in ("amp_lab", "peer")]
        + [f"{c.wall_ratio:.3f}"]
        for c in comparisons
        if c.ratio is not None
    ]
    return _section(
        "Peer: amp_lab vs timm's train.py (training samples/s after warm-up and whole-process "
        "wall time, medians of rounds; ratios amp_lab / peer, the median round's)",
        "model | precision | batch | image | epochs | rounds | amp_lab samples/s | "
        "peer samples/s | **ratio** (rounds' range) | amp_lab wall s | peer wall s | wall ratio",
        rows,
        [f"- data: {c.data}; peer: `{' '.join(c.peer_command[1:])}`" for c in comparisons],
    )


def write_report(out_dir: Path, env: dict[str, Any], results: dict[str, list[Any]]) -> None:
    """Write bench.json and bench.md (atomically, so a reader never sees half a file) from
    `results`, RESULTS' lists."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {key: results.get(key, []) for key in RESULTS}
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
            *compile_cache_section(data["compile_cache"]),
            *overhead_section(data["overhead"]),
            *throughput_section(data["throughput"], data["throughput_errors"]),
            *feed_section(data["feed"]),
            *peer_section(data["peer"]),
        ]
    )
    # dataclasses (a comparison's runs too) as their fields
    text = json.dumps({"environment": env, **data}, indent=2, default=asdict)
    write_bytes_atomic(out_dir / "bench.json", text.encode())
    write_bytes_atomic(out_dir / "bench.md", markdown.encode())
