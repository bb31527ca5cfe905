"""`amp_lab audit <overrides> [--out DIR]`: the precision audit of one step of the run, untrained:
the dtype each GEMM, weight, gradient, optimizer state and the loss had, against the mode's
promise. Exit code 0 when every promise held, 2 when one broke (or on bad input), said in a line.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from dataclasses import replace
from pathlib import Path

from amp_lab.choices import AuditMode
from amp_lab.command import error, parser, run_tool
from amp_lab.records import AUDIT_FILE
from amp_lab.tools import probe


def parse_args(argv: list[str]) -> argparse.Namespace:
    cli = parser(
        "amp_lab audit",
        description="Run one training step under the precision audit and print what it computed "
        "in; nothing is trained or kept but precision_audit.json.",
    )
    cli.add_argument("overrides", nargs="*", help="the run's overrides, e.g. precision=bf16")
    cli.add_argument("--out", type=Path, help=f"where {AUDIT_FILE} goes (default: a temp dir)")
    return cli.parse_args(argv)


def audit_one_step(overrides: list[str], out: Path) -> dict:
    """Build the run of `overrides` in `out`, take its first step under the audit; the audit's
    record (BrokenPromise when a promise broke and audit.mode is not warn)."""
    settings = probe.settings(overrides, "trainer.max_steps=1")
    if settings.audit.mode == AuditMode.off:  # asked for an audit: it runs
        settings = replace(settings, audit=replace(settings.audit, mode=AuditMode.stop))
    with probe.built(settings, out) as run, run.audit.around(1):
        run.train_step(probe.first_micro_batches(run), step=1)
    assert run.audit.result is not None
    return run.audit.result


def main(argv: list[str] | None = None) -> int:
    return run_tool(parse_args, _audit, argv)


def _audit(args: argparse.Namespace) -> int:
    from amp_lab.audit.audit import BrokenPromise  # torch loads once the arguments are read

    out = args.out or Path(tempfile.mkdtemp(prefix="amp_lab_audit_"))
    logging.getLogger("amp_lab.audit.audit").setLevel(logging.ERROR)  # printed below, once
    try:
        result = audit_one_step(args.overrides, out)
    except BrokenPromise as err:
        return error(f"{err} ({out / AUDIT_FILE})")
    print(result["headline"])
    print("promise: " + ", ".join(f"{key} {value}" for key, value in result["promise"].items()))
    for breach in result["breaches"]:  # audit=warn: reported, not fatal
        print(f"broken: {breach['line']}")
    print(f"details: {out / AUDIT_FILE}")
    return 0 if result["kept"] else 2
