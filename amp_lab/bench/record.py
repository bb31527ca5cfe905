"""The benchmark's record: environment, exact command, results, as JSON and a markdown table."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import timm
import torch

from amp_lab.bench.compile_cache import CompileRecord
from amp_lab.bench.feed import FeedRow
from amp_lab.bench.flops import device_name
from amp_lab.bench.overhead import OverheadResult
from amp_lab.bench.peer import PeerComparison
from amp_lab.bench.throughput import ThroughputRow


def environment(device: torch.device, argv: list[str]) -> dict[str, Any]:
    """Date, machine, versions and the exact command: what a reader needs to trust a figure."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m amp_lab.bench", *map(shlex.quote, argv)]),
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
        return "nan" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


def compile_cache_table(records: list[CompileRecord]) -> str:
    lines = ["| model | precision | first step s |", "|---|---|---|"]
    for r in records:
        first = f"{r.first_step_s:.1f}" if r.first_step_s is not None else f"failed: {r.error}"
        lines.append(f"| {r.model} | {r.precision} | {first} |")
    return "\n".join(lines)


def overhead_table(results: list[OverheadResult]) -> str:
    lines = [
        "| model | variant | precision | amp_lab ms/step | bare ms/step | median ratio | "
        "min | max | CPU-time ratio | rounds | runs' median ratios |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.model} | {r.variant} | {r.precision} | {statistics.median(r.amp_lab_ms):.2f} | "
            f"{statistics.median(r.bare_ms):.2f} | **{r.median_ratio:.3f}** | "
            f"{min(r.ratios):.3f} | {max(r.ratios):.3f} | {r.median_cpu_ratio:.3f} | "
            f"{len(r.ratios)} | {', '.join(f'{m:.3f}' for m in r.run_medians)} |"
        )
    return "\n".join(lines)


def throughput_table(rows: list[ThroughputRow], errors: list[dict[str, Any]]) -> str:
    lines = [
        "| model | precision | compile | channels_last | batch | first step s | samples/s | "
        "step ms | fwd ms | bwd ms | opt ms | peak MB | state | state MB | TFLOP/s | MFU | "
        "vs fp32 | fp8 Linears |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "—"
        speedup = f"{r.speedup_vs_fp32:.2f}×" if r.speedup_vs_fp32 is not None else "—"
        lines.append(
            f"| {r.model} | {r.precision} | {_fmt(r.compile)} | {_fmt(r.channels_last)} | "
            f"{r.batch_size} | {_fmt(r.first_step_s)} | {r.samples_per_s:.1f} | "
            f"{r.step_ms:.2f} | {r.forward_ms:.2f} | {r.backward_ms:.2f} | "
            f"{r.optimizer_ms:.2f} | {r.peak_memory_mb:.0f} | {r.state_dtype} | "
            f"{r.state_mb:.2f} | "
            f"{_fmt(r.achieved_tflops)} | {mfu} | {speedup} | "
            f"{f'{r.fp8_linears} ({r.fp8_recipe})' if r.fp8_recipe else '—'} |"
        )
    for e in errors:
        lines.append(
            f"| {e['model']} | {e['precision']} | {_fmt(e['compile'])} | "
            f"failed: {e['error']} |" + " |" * 14
        )
    return "\n".join(lines)


def feed_table(rows: list[FeedRow]) -> str:
    lines = [
        "| model | precision | data | workers | samples/s | data share | vs synthetic |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.precision} | {r.data} | {r.workers} | {r.samples_per_s:.1f} | "
            f"{_fmt(r.data_share, 2)} | {_fmt(r.vs_synthetic)} |"
        )
    return "\n".join(lines)


def peer_table(comparisons: list[PeerComparison]) -> str:
    lines = [
        "| model | precision | batch | image | epochs | rounds | amp_lab samples/s | "
        "peer samples/s | **ratio** (rounds' range) | amp_lab wall s | peer wall s | "
        "wall ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        if not any(r.program == "amp_lab" for r in c.runs):
            continue  # the first round's peer run alone: no ratio yet
        walls = {
            p: statistics.median(r.wall_s for r in c.runs if r.program == p)
            for p in ("amp_lab", "peer")
        }
        rounds = sum(r.program == "amp_lab" for r in c.runs)
        lines.append(
            f"| {c.model} | {c.precision} | {c.batch_size} | {c.img_size} | {c.epochs} | "
            f"{rounds} | {c.amp_lab_samples_per_s:.1f} | {c.peer_samples_per_s:.1f} | "
            f"**{c.ratio:.3f}** ({min(c.ratios):.2f}–{max(c.ratios):.2f}) | "
            f"{walls['amp_lab']:.1f} | {walls['peer']:.1f} | {c.wall_ratio:.3f} |"
        )
    return "\n".join(lines)


def write_report(
    out_dir: Path,
    env: dict[str, Any],
    compile_cache: list[CompileRecord],
    overhead: list[OverheadResult],
    rows: list[ThroughputRow],
    errors: list[dict[str, Any]],
    feed: list[FeedRow],
    peer: list[PeerComparison],
) -> str:
    """Write bench.json and bench.md (atomically, so a reader never sees half a file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "environment": env,
        "compile_cache": [asdict(r) for r in compile_cache],
        "overhead": [
            {**asdict(r), "median_ratio": r.median_ratio, "median_cpu_ratio": r.median_cpu_ratio}
            for r in overhead
        ],
        "throughput": [asdict(r) for r in rows],
        "throughput_errors": errors,
        "feed": [asdict(r) for r in feed],
        "peer": [
            {**asdict(c), "ratios": c.ratios, "ratio": c.ratio, "wall_ratio": c.wall_ratio}
            if any(r.program == "amp_lab" for r in c.runs)
            else asdict(c)
            for c in peer
        ],
    }
    header = [
        f"# amp_lab benchmark — {env['date']}",
        "",
        f"- device: {env['device']} ({env['device_type']}), torch {env['torch']}, "
        f"timm {env['timm']}, CUDA {env['cuda']}, Python {env['python']}",
        f"- CPU: {env['cpu_count']} cores, {env['torch_threads']} torch threads, "
        f"load average {env['load_average_1m']:.2f} at the start",
        f"- command: `{env['command']}`",
        "",
    ]
    parts = header
    if compile_cache:
        parts += [
            "## torch.compile caches filled (each configuration's first step, with "
            "compilation, run in parallel processes)",
            "",
            compile_cache_table(compile_cache),
            "",
        ]
    if overhead:
        parts += [
            "## Overhead: amp_lab step / bare loop (median of rounds; wall time, and "
            "process CPU time)",
            "",
            overhead_table(overhead),
            "",
        ]
    if rows or errors:
        parts += ["## Throughput", "", throughput_table(rows, errors), ""]
    if feed:
        parts += [
            "## Feed: synthetic data vs JPEG files decoded on the host and on the device "
            "(samples/s after warm-up; data share: time waiting for batches)",
            "",
            feed_table(feed),
            "",
        ]
    if peer:
        parts += [
            "## Peer: amp_lab vs timm's train.py (training samples/s after warm-up and "
            "whole-process wall time, medians of rounds; ratios amp_lab / peer, the median "
            "round's)",
            "",
            peer_table(peer),
            "",
            *(f"- data: {c.data}; peer: `{' '.join(c.peer_command[1:])}`" for c in peer),
            "",
        ]
    markdown = "\n".join(parts)
    for name, text in [("bench.json", json.dumps(data, indent=2)), ("bench.md", markdown)]:
        tmp = out_dir / f"{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out_dir / name)
    return markdown
