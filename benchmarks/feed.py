"""`--parts feed`: can real files feed the device?

The same model and steps on synthetic data, then on a JPEG ImageFolder decoded by PIL in the
loader workers (`data.decode=cpu`), then decoded on the training device. Each is an ordinary run;
its figures are its own `mean_samples_per_s` and mean `throughput/data_share` (near 1: the data
path bounds the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch

from amp_lab.records import METRICS_FILE
from amp_lab.tools import probe
from amp_lab.tools.bench import record
from amp_lab.tools.bench.runs import Report, run_overrides
from benchmarks.peer import peer_data


@dataclass
class FeedRow:
    model: str
    precision: str
    data: str  # synthetic | imagefolder decode=cpu | imagefolder decode=gpu (or device)
    workers: int
    samples_per_s: float
    data_share: float | None  # mean of the run's log records
    vs_synthetic: float | None = None  # samples/s over the synthetic row's


def part(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """One run per source of --models[0] x --precisions[0], --warmup + --steps steps each:
    synthetic, then the host decode, then the device decode this device has."""
    root, steps = peer_data(args), args.warmup + args.steps
    timing = [
        f"trainer.max_steps={steps}",
        f"trainer.timing_warmup={args.warmup}",
        f"trainer.eval_every={steps + 1}",  # one evaluation, after the last step
        "checkpoint.enabled=false",
    ]
    rows: list[FeedRow] = []
    for source in ["synthetic", "cpu", "gpu" if device.type == "cuda" else "device"]:
        data = (  # synthetic: 10 batches in device memory, the folder's 10 classes
            ["data=synthetic", f"data.num_samples={10 * args.batch_size}", "data.num_classes=10"]
            if source == "synthetic"
            else ["data=imagefolder", f"data.root={root}", f"data.decode={source}"]
        )
        overrides = [*data, f"data.num_workers={args.workers}", *timing]
        run = run_overrides(args, args.models[0], args.precisions[0], *overrides)
        settings = probe.settings(run, quiet=False)
        run_dir = args.out / "runs" / f"feed_{settings.model.name}_{source}"
        summary = probe.fit(settings, run_dir)
        records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
        shares = [r["throughput/data_share"] for r in records if "throughput/data_share" in r]
        rows.append(
            FeedRow(
                settings.model.name,
                str(settings.precision.name),
                "synthetic" if source == "synthetic" else f"imagefolder decode={source}",
                0 if source == "synthetic" else settings.data.num_workers,
                float(summary["mean_samples_per_s"]),
                statistics.mean(shares) if shares else None,
            )
        )
        rows[-1].vs_synthetic = rows[-1].samples_per_s / rows[0].samples_per_s
        report(feed=rows)
        share = rows[-1].data_share
        print(
            f"feed {rows[-1].data}: {rows[-1].samples_per_s:.1f} samples/s, data share "
            f"{share if share is not None else float('nan'):.2f}",
            file=sys.stderr,
        )


def section(results: dict[str, list[Any]]) -> list[str]:
    rows: list[FeedRow] = results.get("feed", [])
    cells = [
        [r.model, r.precision, r.data, str(r.workers), f"{r.samples_per_s:.1f}"]
        + [record.fmt(r.data_share, 2), record.fmt(r.vs_synthetic)]
        for r in rows
    ]
    return record.section(
        "Feed: synthetic data vs JPEG files decoded on the host and on the device "
        "(samples/s after warm-up; data share: time waiting for batches)",
        "model | precision | data | workers | samples/s | data share | vs synthetic",
        cells,
    )
