"""`python -m amp_lab doctor <overrides> [--steps N] [--search-fp32] [--budget S] [--out DIR]`
(diagnose.py). Bad input is one line and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator

from rich.console import Console

from amp_lab.command import run_tool
from amp_lab.tools.doctor.arguments import parse_args


def main(argv: list[str] | None = None) -> int:
    return run_tool(parse_args, _doctor, argv)


# their warnings about each probe go to doctor.json (the audit's to its precision_audit.json)
QUIET = ("amp_lab.build", "amp_lab.trainer", "amp_lab.diagnostics.observer", "amp_lab.audit.audit")


@contextlib.contextmanager
def quiet_probes() -> Iterator[Console]:
    """The doctor's console, the probes' loggers quiet meanwhile (their levels restored after)."""
    levels = {name: logging.getLogger(name).level for name in QUIET}
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield Console(width=None if sys.stdout.isatty() else 160)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _doctor(args: argparse.Namespace) -> int:
    from amp_lab.tools.doctor.diagnose import run  # torch and timm load once the arguments parsed

    with quiet_probes() as console:
        run(args, console)
    return 0
