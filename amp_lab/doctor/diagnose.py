"""`python -m amp_lab.doctor <overrides> [--steps N] [--search-fp32] [--budget S] [--out DIR]`.

Automates the debugging flow of docs/amp_pitfalls.md §5 on the user's own config: short
in-process probes with the same seed and data order — (1) the fp32 baseline, (2) autocast without
a scaler, (3) autocast with the scaler, (4) bf16 where the device has it — judged by the
run-health rules and compared with the baseline step by step. Prints a verdict table and ranked
recommendations (advice.py), runs the top ones as probes to verify them (fixes.py) and writes
doctor.json. `--search-fp32` greedily finds modules to keep in fp32 that remove the non-finite
values; `--suite` runs the doctor benchmark (suite.py) instead of the user's config.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from amp_lab.choices import Strategy
from amp_lab.config import ConfigError, HealthConfig, compose_settings
from amp_lab.doctor.advice import Advice, recommend
from amp_lab.doctor.fixes import applied_by, command, key, verify
from amp_lab.doctor.verdict import Probe, first_event, verdict
from amp_lab.records import METRICS_FILE

# keys the doctor sets itself; the user's values for them are replaced per probe
PROBE_KEYS = (
    "precision",
    "scaler.enabled",
    "trainer.max_steps",
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.progress",
    "trainer.resume",
    "trainer.strategy",
    "checkpoint.enabled",
    "diagnostics",
    "diagnostics.mode",
    "diagnostics.every",
    "hydra.run.dir",
)
log = logging.getLogger("amp_lab.doctor")


class Doctor:
    """Runs the probes of one user config and collects what they saw."""

    def __init__(self, overrides: list[str], steps: int, out: Path) -> None:
        self.user, self.steps, self.out = overrides, steps, out
        self.settings = compose_settings(overrides)  # bad overrides fail here, before any run
        self.health = self.settings.health  # the judge's thresholds, the user's own
        import torch  # torch and timm load only after the config parsed

        from amp_lab.build import build
        from amp_lab.precision.modes import PRECISION_MODES

        kept = [o for o in overrides if key(o) not in PROBE_KEYS]
        # every probe starts afresh (an earlier doctor's files in --out are set aside)
        self.common = [
            *kept,
            f"trainer.max_steps={steps}",
            "trainer.log_every=1",
            "trainer.eval_every=0",
            "trainer.progress=false",
            "diagnostics=full",
            "diagnostics.every=1",
            "trainer.resume=false",
            "trainer.strategy=single",  # the probes are short runs on one process
            "checkpoint.enabled=false",
        ]
        if self.settings.trainer.strategy == "fsdp":  # its policy is checked, its probes not
            from amp_lab.components.fsdp import resolve_plan

            resolve_plan(self.settings)
            log.info("trainer.strategy=fsdp: the doctor's probes run on one process, unsharded")
        # the user's own config is valid on this machine: it builds (in a folder it never
        # writes to, so an --out that holds a run is left alone)
        single = replace(self.settings.trainer, strategy=Strategy.single)
        build(replace(self.settings, trainer=single), out / "probes" / "config_check")
        # the probes' autocast dtype: the user's (bf16_pure and fp8 compute in bf16)
        mode = PRECISION_MODES[self.settings.precision.name]
        self.low = "bf16" if mode.autocast_dtype == torch.bfloat16 else "fp16"
        # what the user runs (a fix is verified on it): their precision and scaler, or, for
        # an fp32 config, the autocast+scaler probe's
        own = [o for o in overrides if key(o) in ("precision", "scaler.enabled")]
        self.own = (
            own
            if mode.autocast_dtype is not None
            else [f"precision={self.low}", "scaler.enabled=true"]
        )
        scaler = self.settings.scaler
        self.user_scaled = mode.autocast_dtype is None or (
            scaler.kind != "static"
            and (mode.dynamic_scaling if scaler.enabled is None else scaler.enabled)
        )

    def plan(self) -> list[tuple[str, list[str]]]:
        plan = [
            ("fp32", ["precision=fp32", "pitfall=none", "scaler.enabled=false"]),
            ("autocast", [f"precision={self.low}", "scaler.enabled=false"]),
            ("autocast+scaler", [f"precision={self.low}", "scaler.enabled=true"]),
        ]
        if self.low != "bf16":
            plan.append(("bf16", ["precision=bf16", "scaler.enabled=false"]))
        return plan

    def run_probe(self, name: str, extra: list[str]) -> Probe:
        """A short in-process run; its files go to <out>/probes/<name>."""
        from amp_lab.build import build  # torch and timm load only when a probe runs
        from amp_lab.trainer import Trainer

        replaced = {key(e) for e in extra}
        probe = Probe(name, [*(o for o in self.common if key(o) not in replaced), *extra])
        try:
            trainer = Trainer(build(compose_settings(probe.overrides), self.out / "probes" / name))
        except ConfigError as err:
            if name != "bf16":
                raise
            probe.unavailable = str(err)  # bf16 only where the device has it
            return probe
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # the probe's own progress, table
                probe.summary = trainer.fit()
        except Exception as err:  # noqa: BLE001 - a probe that crashes is a finding, not the end
            probe.crashed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if name == "fp32":
                raise ConfigError(
                    f"the fp32 baseline crashed ({probe.crashed}); fix that first: "
                    f"python -m amp_lab {' '.join(self.user)} precision=fp32 "
                    "shows the traceback"
                ) from err
            log.warning("probe %s crashed: %s", name, probe.crashed)
            return probe
        rows = [
            json.loads(line)
            for line in (trainer.run.out_dir / METRICS_FILE).read_text().splitlines()
        ]
        probe.records = [r for r in rows if r["kind"] == "train"]
        probe.losses = [r["train/loss"] for r in probe.records]
        log.info("probe %s: %s", name, " ".join(extra))
        return probe

    def search_fp32(self, start: list[str], scaled: Probe, max_rounds: int = 6) -> dict[str, Any]:
        """Greedy: add the module named by the forward attribution until a probe runs clean.
        `scaled` (the autocast+scaler probe) is the run with the `start` set; a set already run
        is not run again (the probes are deterministic for a seed)."""
        extra = [f"precision={self.low}", "scaler.enabled=true"]
        chosen = list(start)
        tried: list[dict[str, Any]] = []
        runs: dict[tuple[str, ...], Probe] = {tuple(start): scaled}

        def clean(modules: list[str]) -> bool:
            key = tuple(modules)
            if key not in runs:
                runs[key] = self.run_probe(
                    f"search_{len(runs) - 1}",
                    [*extra, f"precision.fp32_modules=[{','.join(modules)}]"],
                )
            probe = runs[key]
            forward = (probe.diag.get("nonfinite") or {}).get("forward")
            ok = not (forward or probe.crashed or probe.summary.get("diverged"))
            if not tried or tried[-1]["fp32_modules"] != list(modules):
                tried.append(
                    {
                        "fp32_modules": list(modules),
                        "clean": ok,
                        "forward_nonfinite": forward,
                        "crashed": probe.crashed,
                    }
                )
            return ok

        def result(found: bool) -> dict[str, Any]:
            return {
                "found": found,
                "verified": found,
                "fp32_modules": chosen,
                "tried": tried,
                "probe_runs": len(runs) - 1,
            }

        for _ in range(max_rounds):
            if clean(chosen):
                break
            culprit = tried[-1]["forward_nonfinite"]
            if culprit is None or culprit["module"] in chosen:
                return result(False)
            chosen.append(culprit["module"])
        else:
            return result(False)
        for module in [m for m in chosen if m not in start] if len(chosen) > 1 else []:
            smaller = [m for m in chosen if m != module]
            if clean(smaller):  # drop modules the others already cover
                chosen = smaller
        return result(clean(chosen))  # the final set, run with every module of it


def _strict_json(value: Any) -> Any:
    """nan/inf (a diverged loss) as null: strict JSON readers (jq, JavaScript) reject NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def verdict_table(probes: dict[str, Probe], health: HealthConfig) -> Table:
    """One row per probe: its verdict against the fp32 baseline, its health findings (the
    judge's words, as in its summary.json) and the numerics behind it."""
    base = probes["fp32"]
    table = Table(title="amp_lab doctor: probes vs the fp32 baseline")
    for column in [
        "probe",
        "verdict",
        "health",
        "loss first -> last",
        "vs fp32",
        "first non-finite",
        "skipped",
        "scale",
        "zero grads",
        "fp16 flush@scale",
        "upd/weight",
    ]:
        table.add_column(column, no_wrap=column in ("probe", "first non-finite"))
    for name, p in probes.items():
        if p.unavailable or p.crashed:
            why = p.unavailable or p.crashed or ""
            table.add_row(name, verdict(p, base, health), "", escape(why), *[""] * 7)
            continue
        event = first_event(p)  # the same event the advice reads
        where = (
            "-"
            if not event
            else (
                f"step {event['step']}: {event['module']} ({event['phase']})"
                if event["module"]
                else f"step {event['step']}: skipped, no module named"
            )
        )  # the weight gradients
        # overflowed, or the scale did, while no activation or input gradient was non-finite
        ratio = p.mean("diag/update_ratio")
        table.add_row(
            name,
            verdict(p, base, health),
            escape("; ".join(p.health) or "ok"),
            _fmt_curve(p),
            _fmt(p.deviation(base), "%"),
            where,
            f"{p.summary.get('skipped_steps', 0)}/{p.summary.get('steps', 0)}",
            f"{p.summary.get('final_loss_scale', 0):g}",
            _fmt(p.flushed, "%"),
            _fmt(p.would_flush, "%"),
            "-" if ratio is None else f"{ratio:.2e}",
        )
    return table


def _fmt(value: float | None, kind: str) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.1%}" if kind == "%" else f"{value:.3g}"


def _fmt_curve(p: Probe) -> str:
    return f"{p.losses[0]:.4g} -> {p.losses[-1]:.4g}" if p.losses else "-"


def print_report(
    console: Console,
    health: HealthConfig,
    probes: dict[str, Probe],
    recs: list[dict],
    search: dict | None,
    user: list[str],
) -> None:
    console.print(verdict_table(probes, health))
    if search:
        state = "verified: no non-finite value with it" if search["verified"] else "NOT found"
        modules = ",".join(search["fp32_modules"])
        console.print(
            escape(
                f"fp32 search: precision.fp32_modules=[{modules}] ({state}, "
                f"{search['probe_runs']} probe run"
                f"{'' if search['probe_runs'] == 1 else 's'})"
            )
        )
    console.print("[bold]Recommendations[/bold] (most urgent first)")
    for i, rec in enumerate(recs, 1):
        console.print(f"{i}. [bold]{escape(rec['problem'])}[/bold]: {escape(rec['evidence'])}")
        if rec["fix"]:
            console.print(escape(f"   fix: {rec['fix']}"))
        if rec["override"]:
            console.print(
                escape(f"   try: {command(user, rec['override'])}"), soft_wrap=True
            )  # one line: copy and paste it
        if rec.get("verification"):
            console.print(escape(f"   {rec['verification']}"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m amp_lab.doctor",
        description="Probe your config in fp32, autocast without and with the loss scaler, and "
        "bf16; name what goes wrong numerically and the override to try.",
    )
    parser.add_argument("overrides", nargs="*", help="your usual overrides, e.g. precision=fp16")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per probe (40)")
    parser.add_argument(
        "--search-fp32",
        action="store_true",
        help="greedily find modules to keep in fp32 that remove non-finite values",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=60.0,
        help="seconds for verifying fixes after the first (60)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default outputs/doctor/DATE/TIME; with --suite outputs/doctor_suite)",
    )
    parser.add_argument(
        "--suite",
        action="store_true",
        help="run the doctor benchmark (failure cases with a known cause) "
        "instead of your config; see amp_lab/doctor/suite.py",
    )
    parser.add_argument(
        "--cases", nargs="+", default=None, metavar="NAME", help="with --suite: only these cases"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """All probes, the optional fp32 search, the report and doctor.json."""
    if args.steps < 4:
        raise ConfigError(f"--steps={args.steps} is too short to compare curves; use >= 4")
    out = args.out or Path("outputs/doctor") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    doctor = Doctor(args.overrides, args.steps, out)
    probes = {}
    for name, extra in doctor.plan():
        console.print(escape(f"probe {name}: {' '.join(extra)} ({args.steps} steps)"))
        probes[name] = doctor.run_probe(name, extra)
    s = doctor.settings
    search = None
    if args.search_fp32 and any(
        (p.diag.get("nonfinite") or {}).get("forward") for p in probes.values() if p.name != "fp32"
    ):
        search = doctor.search_fp32(list(s.precision.fp32_modules), probes["autocast+scaler"])
    advice = Advice(
        s.scaler.init_scale,
        s.scaler.growth_interval,
        s.lr.scale,
        s.lr.warmup_steps,
        args.steps,
        doctor.low,
        doctor.user_scaled,
        s.trainer.clip_grad,
        tuple(s.precision.fp32_modules),
        doctor.health,
    )
    recs = recommend(
        probes,
        advice,
        search["fp32_modules"] if search and search["found"] else None,
        applied_by(args.overrides, s),
    )
    verify(doctor, recs, probes, advice, args.budget)
    for rec in recs:
        rec["command"] = command(args.overrides, rec["override"]) if rec["override"] else None
    print_report(console, doctor.health, probes, recs, search, args.overrides)
    report = {
        "overrides": args.overrides,
        "steps": args.steps,
        "output_dir": str(out),
        "user_probe": "autocast+scaler" if doctor.user_scaled else "autocast",
        "probes": {
            n: {
                "overrides": p.overrides,
                "verdict": verdict(p, probes["fp32"], doctor.health),
                "health": p.health,
                "unavailable": p.unavailable,
                "crashed": p.crashed,
                "losses": p.losses,
                "deviation_from_fp32": p.deviation(probes["fp32"]) if p.losses else None,
                "zero_grad_share": p.flushed,
                "fp16_flush_share_at_scale": p.would_flush,
                "skip_rate": p.skip_rate,
                "update_ratio": p.mean("diag/update_ratio"),
                "summary": p.summary,
            }
            for n, p in probes.items()
        },
        "recommendations": recs,
        "search_fp32": search,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "doctor.json").write_text(
        json.dumps(_strict_json(report), indent=2, default=str, allow_nan=False)
    )
    console.print(f"wrote {out / 'doctor.json'}")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    quiet = [
        logging.getLogger(name)
        for name in ("amp_lab.build", "amp_lab.trainer", "amp_lab.numerics.diagnostics")
    ]
    levels = [logger.level for logger in quiet]
    for logger in quiet:  # the probes' warnings go to doctor.json
        logger.setLevel(logging.ERROR)
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        if args.suite:
            from amp_lab.doctor.suite import main as suite

            return suite(args, console)
        run(args, console)
    except ConfigError as err:
        print(f"amp_lab: error: {err}", file=sys.stderr)
        return 2
    finally:  # as they were: `amp_lab doctor` may run inside a longer-lived process
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return 0
