"""`amp_lab numerics <overrides> --vs fp32|compiled [--also MODE ...] [--steps N] [--out DIR]`
(docs/diagnostics.md). Exit code 0 when every module stays in its band, 1 when one leaves it (a
finding, not an error), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from amp_lab.command import dated, parser, run_tool, strict_json
from amp_lab.config import ConfigError

NUMERICS_FILE, PLOT_FILE = "numerics.json", "numerics.png"
SHOWN = 8  # flagged rows printed per mode and phase (numerics.json keeps all)


def parse_args(argv: list[str]) -> argparse.Namespace:
    cli = parser(
        "amp_lab numerics",
        description="Run one batch through the same weights in the precision under test and in "
        "its reference, and compare every module's output, input gradient and weight gradient "
        "against the error band its dtype explains (docs/diagnostics.md).",
    )
    cli.add_argument("overrides", nargs="*", help="the run's overrides, e.g. precision=bf16")
    cli.add_argument(
        "--vs",
        choices=["fp32", "compiled"],
        default="fp32",
        help="fp32: the same run in fp32; compiled: the mode eager against "
        "trainer.compile=model, each measured against fp32 (default fp32)",
    )
    cli.add_argument(
        "--also", nargs="+", default=[], metavar="MODE", help="with --vs fp32: more modes to plot"
    )
    cli.add_argument(
        "--steps",
        type=int,
        default=0,
        metavar="N",
        help="with --vs fp32: also train both N steps from the same weights and data order, and "
        "report where their weights part ways faster than rounding explains",
    )
    cli.add_argument("--out", type=Path, help="output folder (default outputs/numerics/DATE)")
    return cli.parse_args(argv)


def _where(row: dict[str, Any] | None) -> str:
    if row is None:
        return "none: every module in its band"
    return f"{row['module'] or '(model)'} ({row['flag']}, {_ratio(row)})"


def _ratio(row: dict[str, Any]) -> str:
    """A flagged row's figure: its share of non-finite elements, else its error against its band."""
    if row["flag"] == "non-finite":
        return f"{row['nonfinite']:.1%} of its elements"
    return f"{row['norm']:.2e} = {row['ratio']:.1f}x band"


def table(result: dict[str, Any]) -> list[str]:
    """The console report: per mode the output, first flagged modules, amplifiers, flagged rows."""
    lines = []
    for mode, found in result["modes"].items():
        out = found["output"]
        lines += [
            f"{mode} vs fp32 (loss scale {found['loss_scale']:g})",
            f"  output: logit KL {out['logit_kl']:.2e}, top-1 agreement "
            f"{out['top1_agreement']:.1%}, loss diff {out['loss_diff']:+.2e}",
            f"  first out of band, forward:  {_where(found['first_out_of_band']['forward'])}",
            f"  first out of band, backward: {_where(found['first_out_of_band']['backward'])}",
        ]
        if found["amplifiers"]:
            gains = ", ".join(f"{a['module']} {a['gain']:.1f}x" for a in found["amplifiers"])
            lines.append(f"  amplify error most: {gains}")
        if "drift" in found:
            from amp_lab.tools.numerics.weight_drift import drift_lines  # torch: only once it ran

            lines += drift_lines(found["drift"])
        for phase in ("forward", "backward", "params"):
            if rows := [r for r in found[phase] if r["flag"]]:
                lines.append(f"  {phase}: {len(rows)} of {len(found[phase])} rows flagged")
                lines += [  # each in a line of an 80-column terminal; numerics.json has the rest
                    f"    {r['module'] or '(model)'} ({r['dtype']}): {r['flag']}, {_ratio(r)}"
                    for r in rows[:SHOWN]
                ]
    for flag in result.get("compiled_flags", []):
        lines.append(f"compiled: {flag['kind']} ({flag['where']})")
    return lines


def flagged(result: dict[str, Any]) -> bool:
    """Whether any module left its band (or the compiled step differs from eager)."""
    return bool(result.get("compiled_flags")) or any(
        found["first_out_of_band"][phase]
        for found in result["modes"].values()
        for phase in ("forward", "backward")
    )


def main(argv: list[str] | None = None) -> int:
    return run_tool(parse_args, _numerics, argv)


def _numerics(args: argparse.Namespace) -> int:
    from amp_lab.precision.modes import PRECISION_MODES
    from amp_lab.tools.numerics.error_plot import plot  # after parsing: --help stays fast
    from amp_lab.tools.numerics.find import find

    out = dated(args.out, "outputs/numerics")
    if (args.also or args.steps) and args.vs != "fp32":
        raise ConfigError("--also and --steps go with --vs fp32; drop them or --vs")
    if unknown := [m for m in args.also if m not in PRECISION_MODES]:
        raise ConfigError(
            f"--also {unknown[0]}: not a precision mode (use {', '.join(PRECISION_MODES)})"
        )
    if args.steps < 0:
        raise ConfigError(f"--steps={args.steps} must be >= 0")
    out.mkdir(parents=True, exist_ok=True)
    result = find(args.overrides, args.vs, args.also, out, args.steps)
    # inf and nan as strings: an infinite error is the finding, and strict JSON has no inf
    (out / NUMERICS_FILE).write_text(json.dumps(strict_json(result), indent=2))
    plot(result, out / PLOT_FILE)
    print("\n".join(table(result)))
    print(f"details: {out / NUMERICS_FILE}, plot: {out / PLOT_FILE}")
    return 1 if flagged(result) else 0
