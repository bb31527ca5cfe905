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
    cli.add_argument("--steps", type=int, help="optimizer steps per probe (40; with --suite 12)")
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
    cli.add_argument(
        "--out",
        type=Path,
        help="output folder (default outputs/doctor/DATE/TIME; with --suite outputs/doctor_suite)",
    )
    cli.add_argument(
        "--suite",
        action="store_true",
        help="run the doctor benchmark (failure cases with a known cause) "
        "instead of your config; see amp_lab/tools/doctor/suite.py",
    )
    cli.add_argument("--cases", nargs="+", metavar="NAME", help="with --suite: only these cases")
    cli.add_argument(
        "--draw",
        type=int,
        default=0,
        metavar="N",
        help="with --suite: draw N new cases, every failure class in turn "
        "(amp_lab/tools/doctor/draw.py)",
    )
    cli.add_argument("--seed", type=int, default=0, help="with --suite --draw: the draw's seed (0)")
    cli.add_argument(
        "--models",
        nargs="+",
        metavar="MODEL",
        help="with --suite --draw: draw among these models (test_vit test_convnext resnet18)",
    )
    return cli.parse_args(argv)
