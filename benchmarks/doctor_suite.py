"""The doctor benchmark: failure cases with a known cause, run through the doctor on CPU.

`python -m benchmarks.doctor_suite [--cases NAME ...]` (`make doctor-bench`) runs each case
through the whole doctor and writes suite.json; it exits 1 when a target is missed: the right
cause first in >= 90% of cases, no alarm on the healthy cases, every top fix verified.
`--draw N --seed S [--models M ...]` runs N cases drawn anew instead (doctor_draw.py).
Results of earlier runs, dated: benchmarks/results/doctor_suite.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from amp_lab.command import parser, run_tool
from amp_lab.config import ConfigError
from amp_lab.tools.doctor.arguments import parse_args
from amp_lab.tools.doctor.cli import quiet_probes
from benchmarks.doctor_cases import Case
from benchmarks.doctor_draw import draw

HEALTHY = ("none", "transient")  # causes that mean "no precision problem found"
TARGET_RIGHT_FIRST = 0.9
# seconds for fixes after the top one's first probe: a moved overflow's grown set, the next
# fix when the top one fails (the budget covers the whole verdict)
BUDGET_S = 30.0
CASE_STEPS = 12  # probe steps per case (--steps sets others)
CLASS_KEYS = ("cases", "right_first", "alarms", "fix_verified", "next_line")

FP16 = ("precision=fp16",)
CASES = [
    Case(
        "underflow_without_scaler",
        ("precision=fp16_noscale", "fault.loss_multiplier=1e-6"),
        "underflow_no_scaler",
    ),
    Case(
        "forward_overflow_module",
        (*FP16, "fault.overflow_module=blocks.0.mlp.fc2"),
        "forward_overflow",
    ),
    # the attention block's output passes 65504 (CPU attention keeps its logits in fp32, so
    # the overflow is injected at the block's output)
    Case(
        "attention_overflow",
        (*FP16, "fault.overflow_module=blocks.0.attn", "fault.overflow_factor=1e8"),
        "forward_overflow",
    ),
    Case("lr_too_high", (*FP16, "lr.base=1"), "baseline"),
    # without warmup this LR blows the loss up in fp32 as in fp16 on this small CPU model (no
    # fp16-only variant reproduces here): the doctor names the baseline, and warmup as its fix
    Case("warmup_too_short", (*FP16, "lr.base=0.05"), "baseline"),
    Case("init_scale_too_high", (*FP16, "scaler.init_scale=1e12"), "init_scale_high"),
    Case(
        "eager_scale_growth",
        (*FP16, "scaler.growth_interval=1", "scaler.growth_factor=4"),
        "eager_growth",
    ),
    Case(
        "clip_before_unscale_sgd",
        (*FP16, "pitfall=clip_before_unscale", "trainer.clip_grad=1", "optim=sgd", "lr.base=0.05"),
        "clip_before_unscale",
    ),
    Case(
        "clip_before_unscale_adamw",
        (*FP16, "pitfall=clip_before_unscale", "trainer.clip_grad=1"),
        "clip_before_unscale",
    ),
    Case(
        "no_scaler_update",
        (*FP16, "pitfall=no_scaler_update", "fault.inf_grad_at_step=2"),
        "no_scaler_update",
    ),
    Case(
        "update_every_microbatch",
        (
            *FP16,
            "pitfall=update_every_microbatch",
            "trainer.grad_accum=2",
            "scaler.init_scale=256",
            "scaler.growth_interval=2",
        ),
        "update_every_microbatch",
    ),
    Case("fp16_weights_without_masters", (*FP16, "pitfall=half_model"), "half_model"),
    Case(
        "loss_in_low_precision", (*FP16, "pitfall=loss_in_low_precision"), "loss_in_low_precision"
    ),
    Case("healthy", FP16, "none"),
    Case("one_transient_inf_step", (*FP16, "fault.inf_grad_at_step=3"), "transient"),
]


def run_case(
    case: Case, out: Path, steps: int | None = None, budget_s: float = BUDGET_S
) -> dict[str, Any]:
    """The doctor on one case (`steps` per probe, default CASE_STEPS), its output in
    <out>/<case>.txt; the figures the table shows."""
    from amp_lab.tools.doctor.diagnose import run  # torch loads once the arguments are read

    flags = ["--steps", str(steps or CASE_STEPS), "--budget", f"{budget_s:g}"]
    args = parse_args([*case.base, *case.overrides, *flags, "--out", str(out / case.name)])
    started = time.monotonic()
    with (out / f"{case.name}.txt").open("w", encoding="utf-8") as text:  # the doctor's output
        report = run(args, Console(file=text, width=200))
    top = report["recommendations"][0]
    mine = report["probes"][report["user_probe"]]
    healthy_case = case.cause in HEALTHY
    return {
        "case": case.name,
        "class": case.kind or case.name,
        "expected": case.cause,
        "top_cause": top["cause"],
        "right_first": top["cause"] == case.cause,
        "verdict": mine["verdict"],
        "alarm": healthy_case and top["cause"] not in HEALTHY,
        "fix": top.get("override"),
        "verified": top.get("verified"),
        "verification": top.get("verification"),
        # the doctor's answer: a verified fix among its recommendations, or what to run next
        "fix_verified": any(r.get("verified") for r in report["recommendations"]),
        "next": report["next"],
        "seconds": time.monotonic() - started,
    }


def table(rows: list[dict[str, Any]]) -> Table:
    columns = (
        "case",
        "verdict",
        "expected cause",
        "ranked first",
        "right",
        "top fix",
        "fix verified",
        "s",
    )
    t = Table(*columns, title="amp_lab doctor benchmark")
    for r in rows:
        t.add_row(
            r["case"],
            r["verdict"],
            r["expected"],
            r["top_cause"],
            "yes" if r["right_first"] else "NO",
            r["fix"] or "-",
            {True: "yes", False: "NO", None: "-"}[r["verified"]],
            f"{r['seconds']:.0f}",
        )
    return t


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's figures, per failure class too, and whether each target is met."""
    right = sum(r["right_first"] for r in rows)
    fixes = [r for r in rows if r["fix"]]
    verified = sum(r["verified"] is True for r in fixes)
    alarms = sum(r["alarm"] for r in rows)
    failing = [r for r in rows if r.get("expected") not in HEALTHY]
    seconds = sorted(r["seconds"] for r in rows if "seconds" in r)
    classes: dict[str, dict[str, int]] = {}
    for r in rows:
        c = classes.setdefault(r.get("class", r.get("case", "?")), dict.fromkeys(CLASS_KEYS, 0))
        c["cases"] += 1
        c["right_first"] += r["right_first"]
        c["alarms"] += r["alarm"]
        c["fix_verified"] += bool(r.get("fix_verified"))
        c["next_line"] += bool(r.get("next"))
    return {
        "cases": len(rows),
        "right_first": right,
        "right_first_share": right / len(rows),
        "alarms_on_healthy": alarms,
        "top_fixes": len(fixes),
        "top_fixes_verified": verified,
        # failure cases that ended with a verified fix, or else with the line of what to run
        "failure_cases": len(failing),
        "ended_verified": sum(bool(r.get("fix_verified")) for r in failing),
        "ended_with_next": sum(bool(r.get("next")) for r in failing),
        "median_s": statistics.median(seconds) if seconds else None,
        "max_s": seconds[-1] if seconds else None,
        "per_class": classes,
        "targets_met": right / len(rows) >= TARGET_RIGHT_FIRST
        and alarms == 0
        and verified == len(fixes),
    }


def chosen_cases(args: argparse.Namespace) -> list[Case]:
    """The fixed cases (all, or --cases), or --draw N of them drawn with --seed."""
    if args.draw:
        if args.cases:
            raise ConfigError("--cases picks fixed cases; --draw draws new ones: use one")
        return draw(args.draw, args.seed, args.models)
    known = {c.name: c for c in CASES}
    unknown = [n for n in args.cases or [] if n not in known]
    if unknown:
        raise ConfigError(f"unknown suite case {', '.join(unknown)}; cases: {', '.join(known)}")
    return [known[n] for n in args.cases] if args.cases else CASES


def parse_suite_args(argv: list[str]) -> argparse.Namespace:
    cli = parser("python -m benchmarks.doctor_suite", __doc__.split("\n\n")[0])
    cli.add_argument("--cases", nargs="+", metavar="NAME", help="only these fixed cases")
    cli.add_argument(
        "--draw", type=int, default=0, metavar="N", help="draw N new cases, every class in turn"
    )
    cli.add_argument("--seed", type=int, default=0, help="with --draw: the draw's seed (0)")
    cli.add_argument(
        "--models",
        nargs="+",
        metavar="MODEL",
        help="with --draw: draw among these models (test_vit test_convnext resnet18)",
    )
    cli.add_argument("--steps", type=int, help=f"probe steps per case ({CASE_STEPS})")
    cli.add_argument("--out", type=Path, help="output folder (default outputs/doctor_suite)")
    return cli.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_tool(parse_suite_args, _suite, argv)


def _suite(args: argparse.Namespace) -> int:
    with quiet_probes() as console:
        return suite(args, console)


def suite(args: argparse.Namespace, console: Console) -> int:
    """Run the chosen cases; 0 when every target is met, else 1. suite.json is rewritten after
    every case, so a suite stopped early keeps the figures of the cases it ran."""
    cases = chosen_cases(args)
    out = args.out or Path("outputs/doctor_suite")
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for case in cases:
        console.print(f"case {case.name}: {' '.join(case.overrides)}")
        rows.append(run_case(case, out, args.steps))
        saved = {"draw": args.draw, "seed": args.seed, "figures": figures(rows), "cases": rows}
        (out / "suite.json").write_text(json.dumps(saved, indent=2))
    console.print(table(rows))
    result = figures(rows)
    console.print(
        f"right cause first: {result['right_first']}/{result['cases']} "
        f"({result['right_first_share']:.0%}, target >= {TARGET_RIGHT_FIRST:.0%}); "
        f"alarms on healthy cases: {result['alarms_on_healthy']}; top fixes verified: "
        f"{result['top_fixes_verified']}/{result['top_fixes']}; failure cases ending with a "
        f"verified fix: {result['ended_verified']}/{result['failure_cases']} (else a next line: "
        f"{result['ended_with_next']}); per case median {result['median_s']:.0f} s, "
        f"max {result['max_s']:.0f} s"
    )
    for name, c in result["per_class"].items():
        console.print(
            f"  {name}: right first {c['right_first']}/{c['cases']}, alarms {c['alarms']}, "
            f"verified fix {c['fix_verified']}, next line {c['next_line']}"
        )
    console.print(f"wrote {out / 'suite.json'}")
    return 0 if result["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
