"""The doctor's command line, read before anything heavy is imported: `--help` and a bad
argument answer at once."""

from __future__ import annotations

import argparse
from pathlib import Path

from amp_lab.command import parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    cli = parser(
        "python -m amp_lab doctor",
        description="Probe your config in fp32, autocast without and with the loss scaler, and "
        "bf16; name what goes wrong numerically and the override to try.",
    )
    cli.add_argument("overrides", nargs="*", help="your usual overrides, e.g. precision=fp16")
    cli.add_argument("--steps", type=int, help="optimizer steps per probe (40)")
    cli.add_argument(
        "--search-fp32",
        action="store_true",
        help="greedily find modules to keep in fp32 that remove non-finite values",
    )
    cli.add_argument(
        "--budget",
        type=float,
        default=60.0,
        help="seconds for verifying fixes after the first (60)",
    )
    cli.add_argument("--out", type=Path, help="output folder (default outputs/doctor/DATE/TIME)")
    return cli.parse_args(argv)
