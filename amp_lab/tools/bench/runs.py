"""Every benchmark run's config: the real Hydra configs plus the bench's options, as overrides."""

from __future__ import annotations

import argparse
from collections.abc import Callable

Report = Callable[..., None]  # rewrites bench.json/bench.md with a part's results so far


def run_overrides(args: argparse.Namespace, model: str, precision: str, *extra: str) -> list[str]:
    """Every run's overrides; the user's --override come last, so they win."""
    return [
        f"model={model}",
        f"precision={precision}",
        f"data.img_size={args.img_size}",
        f"trainer.batch_size={args.batch_size}",
        f"trainer.device={args.device}",
        f"trainer.threads={args.threads or 0}",  # 0: the CPUs the process was given
        "trainer.progress=false",
        "trainer.resume=false",  # every run starts afresh, also in an --out used before
        *extra,
        *args.override,
    ]


def synthetic_overrides(
    args: argparse.Namespace, model: str, precision: str, *extra: str
) -> list[str]:
    """A run on synthetic data in device memory: 10 batches (8 for training), distinct batches
    in little memory."""
    return run_overrides(
        args,
        model,
        precision,
        "data=synthetic",
        f"data.num_samples={10 * args.batch_size}",
        "data.num_classes=1000",
        "checkpoint.enabled=false",
        *extra,
    )


def throughput_overrides(
    args: argparse.Namespace, model: str, precision: str, compiled: bool
) -> list[str]:
    """One throughput row's config; compile_cache compiles exactly these, so the caches hit."""
    return synthetic_overrides(
        args,
        model,
        precision,
        f"trainer.compile={str(compiled).lower()}",
        f"trainer.max_steps={args.warmup + 2 * args.steps}",
    )
