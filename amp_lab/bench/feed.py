"""`--parts feed`: can real files feed the device?

The same model and steps on synthetic data, then on a JPEG ImageFolder decoded by PIL in the
loader workers (`data.decode=cpu`), then decoded on the training device. Each is an ordinary run;
its figures are its own `mean_samples_per_s` and mean `throughput/data_share` (near 1: the data
path bounds the run).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from amp_lab.build import build
from amp_lab.compose import compose_settings
from amp_lab.records import METRICS_FILE
from amp_lab.trainer import Trainer


@dataclass
class FeedRow:
    model: str
    precision: str
    data: str  # synthetic | imagefolder decode=cpu | imagefolder decode=gpu (or device)
    workers: int
    samples_per_s: float
    data_share: float | None  # mean of the run's log records
    vs_synthetic: float | None = None  # samples/s over the synthetic row's


def _overrides(base: list[str], source: str, root: Path, batch_size: int) -> list[str]:
    if source == "synthetic":  # 10 batches in device memory, the folder's 10 classes
        return [
            "data=synthetic",
            f"data.num_samples={10 * batch_size}",
            "data.num_classes=10",
            *base,
        ]
    return ["data=imagefolder", f"data.root={root}", f"data.decode={source}", *base]


def measure_feed(
    base: list[str], root: Path, device: torch.device, out: Path, batch_size: int
) -> list[FeedRow]:
    """One run per source of `base` (the model, precision, batch, steps, ... overrides)."""
    rows: list[FeedRow] = []
    # synthetic, then the host decode, then the device decode this device has
    for source in ["synthetic", "cpu", "gpu" if device.type == "cuda" else "device"]:
        settings = compose_settings(_overrides(base, source, root, batch_size))
        run_dir = out / "runs" / f"feed_{settings.model.name}_{source}"
        summary = Trainer(build(settings, run_dir)).fit()
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
    for row in rows:
        row.vs_synthetic = row.samples_per_s / rows[0].samples_per_s
    return rows
