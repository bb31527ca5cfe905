"""`python -m amp_lab doctor <overrides> [--steps N] [--search-fp32] [--budget S] [--out DIR]`,
or `--suite`: a diagnosis of the user's config (diagnose.py) or the doctor's benchmark
(suite.py). Bad input is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rich.console import Console

from amp_lab.command import run_tool
from amp_lab.tools.doctor.arguments import parse_args


def main(argv: list[str] | None = None) -> int:
    return run_tool(parse_args, _doctor, argv)


# their warnings about each probe go to doctor.json, not the terminal
QUIET = (
    "amp_lab.build",
    "amp_lab.trainer",
    "amp_lab.diagnostics.observer",
    "amp_lab.audit.audit",  # each probe's precision_audit.json keeps its audit
)


def _doctor(args: argparse.Namespace) -> int:
    from amp_lab.tools.doctor import (
        suite,  # torch, timm and the rest load once the arguments are read
    )
    from amp_lab.tools.doctor.diagnose import run

    levels = {name: logging.getLogger(name).level for name in QUIET}
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.ERROR)
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        if args.suite:
            return suite.main(args, console)
        run(args, console)
    finally:  # as they were: `amp_lab doctor` may run inside a longer-lived process
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    return 0
