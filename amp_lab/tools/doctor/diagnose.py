"""One diagnosis of the user's config: the probes, their verdicts, the ranked and verified
recommendations (docs/diagnostics.md); the verdict table on the terminal and doctor.json."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from amp_lab.choices import PitfallName
from amp_lab.command import dated, strict_json
from amp_lab.config import ConfigError, HealthConfig
from amp_lab.tools.doctor import mechanism
from amp_lab.tools.doctor.advice import Advice, recommend, user_probe
from amp_lab.tools.doctor.fixes import applied_by, verify
from amp_lab.tools.doctor.probes import Doctor, command
from amp_lab.tools.doctor.verdict import Probe, verdict
from amp_lab.tools.numerics.find import for_doctor

# the table's rows, one column per probe: probes side by side fit an 80-column terminal
MEASURES = (
    *("verdict", "health", "loss first -> last", "vs fp32", "first non-finite"),
    *("skipped", "scale", "zero grads", "fp16 flush@scale", "upd/weight"),
)


def verdict_table(probes: dict[str, Probe], health: HealthConfig, width: int) -> Table:
    """One column per probe: its verdict, health findings and numerics; `width` columns wide."""
    columns = {name: _measures(p, probes["fp32"], health) for name, p in probes.items()}
    names, texts = ["probe", *columns], [MEASURES, *columns.values()]
    natural = [max(len(name), *map(cell_len, col)) for name, col in zip(names, texts)]
    # a rule left of each column and right of the last, a space each side of every cell
    room = width - 3 * len(names) - 1
    # narrowed in turn: while the measures' names stay whole and a figure (3.93e-03) keeps its
    # line, then while the names wrap between words, then a probe's column to its own name
    whole, words = max(map(len, MEASURES)), max(len(w) for m in MEASURES for w in m.split())
    figure = [max(len(name), 8) for name in columns]
    fitted = natural
    for least in ([whole, *figure], [words, *figure], [words, *map(len, columns)]):
        fitted = _fit(fitted, least, room)
    table = Table(
        *(Column(escape(name), overflow="fold", width=w) for name, w in zip(names, fitted)),
        title="amp_lab doctor: probes vs the fp32 baseline",
    )
    for row, measure in enumerate(MEASURES):
        table.add_row(measure, *(escape(cells[row]) for cells in columns.values()))
    return table


def _fit(natural: list[int], least: list[int], room: int) -> list[int]:
    """Column widths summing to at most `room`, the widest narrowed first, none below `least`
    (rich's own fitting stops when the widest columns tie, then crops the table's right side)."""
    widths = list(natural)
    while sum(widths) > room:
        narrower = [i for i, w in enumerate(widths) if w > least[i]]
        if not narrower:
            break
        widths[max(narrower, key=lambda i: widths[i])] -= 1
    return widths


def _measures(p: Probe, base: Probe, health: HealthConfig) -> list[str]:
    """A probe's cell for each of MEASURES."""
    if why := p.unavailable or p.crashed:
        return [verdict(p, base, health), why, *[""] * (len(MEASURES) - 2)]
    event = p.first_event  # the same event the advice reads
    where = "-"
    if event:  # no module: only the weight gradients (or the scale) were non-finite
        named = f"{event['module']} ({event['phase']})" if event["module"] else None
        where = f"step {event['step']}: {named or 'skipped, no module named'}"
    ratio = p.mean("diag/update_ratio")
    return [
        verdict(p, base, health),
        "; ".join(p.health) or "ok",
        p.curve(4) if p.losses else "-",
        _fmt(p.deviation(base)),
        where,
        f"{p.summary.get('skipped_steps', 0)}/{p.summary.get('steps', 0)}",
        f"{p.summary.get('final_loss_scale', 0):g}",
        _fmt(p.flushed),
        _fmt(p.would_flush),
        "-" if ratio is None else f"{ratio:.2e}",
    ]


def _fmt(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.1%}"


def numerics_line(numerics: dict[str, Any]) -> str:
    """The doctor's report of the divergence finder (amp_lab numerics) on its first step."""
    first = numerics["first_out_of_band"]["forward"]
    where = f"{first['module']} ({first['flag']})" if first else "none"
    ranked = ", ".join(numerics["fp32_candidates"]) or "none"
    return (
        f"numerics (step 1 against fp32): first out of band forward {where}; fp32_modules "
        f"candidates, best first: {ranked}"
    )


def print_report(
    console: Console,
    health: HealthConfig,
    probes: dict[str, Probe],
    recs: list[dict],
    search: dict | None,
    scaler_check: dict[str, Any] | None,
) -> None:
    console.print(verdict_table(probes, health, console.width))
    if scaler_check:
        console.print(escape(f"scaler check: {mechanism.describe(scaler_check)}"))
    if search:
        state = "verified: no non-finite value with it" if search["verified"] else "NOT found"
        modules, runs = ",".join(search["fp32_modules"]), search["probe_runs"]
        found = f"precision.fp32_modules=[{modules}] ({state}, {runs} probe run{'s' * (runs != 1)})"
        console.print(escape(f"fp32 search: {found}"))
    console.print("[bold]Recommendations[/bold] (most urgent first)")
    for i, rec in enumerate(recs, 1):
        console.print(f"{i}. [bold]{escape(rec['problem'])}[/bold]: {escape(rec['evidence'])}")
        if rec["fix"]:
            console.print(escape(f"   fix: {rec['fix']}"))
        if rec["command"]:  # one line: copy and paste it
            console.print(escape(f"   try: {rec['command']}"), soft_wrap=True)
        if rec.get("verification"):
            console.print(escape(f"   {rec['verification']}"))


def run_probes(doctor: Doctor, steps: int, console: Console) -> dict[str, Probe]:
    """Each probe of the doctor's plan, in order, told on the console as it starts."""
    probes: dict[str, Probe] = {}
    for name, extra in doctor.plan():
        # a step that overflows forward skips whatever the scaler does: no check to make
        if name == mechanism.NAME and (event := probes["autocast+scaler"].forward):
            why = f"the forward pass overflows ({event['module']}), every step skips"
            console.print(escape(f"probe {name}: skipped: {why}"))
            continue
        length = mechanism.STEPS if name == mechanism.NAME else steps
        console.print(escape(f"probe {name}: {' '.join(extra)} ({length} steps)"))
        probes[name] = doctor.run_probe(name, extra)
    return probes


def probe_record(p: Probe, fp32: Probe, health: HealthConfig) -> dict[str, Any]:
    """A probe as doctor.json holds it."""
    return {
        "overrides": p.overrides,
        "verdict": verdict(p, fp32, health),
        "health": p.health,
        "unavailable": p.unavailable,
        "crashed": p.crashed,
        "losses": p.losses,
        "deviation_from_fp32": p.deviation(fp32) if p.losses else None,
        "zero_grad_share": p.flushed,
        "fp16_flush_share_at_scale": p.would_flush,
        "skip_rate": p.skip_rate,
        "update_ratio": p.mean("diag/update_ratio"),
        "summary": p.summary,
    }


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """All probes, the optional fp32 search, the report and doctor.json."""
    args.steps = args.steps or 40
    if args.steps < 4:
        raise ConfigError(f"--steps={args.steps} is too short to compare curves; use >= 4")
    out = dated(args.out, "outputs/doctor")
    doctor = Doctor(args.overrides, args.steps, out)
    probes = run_probes(doctor, args.steps, console)
    s = doctor.settings
    search = None
    overflowed = any(p.forward for p in probes.values() if p.name != "fp32")
    # the divergence finder ranks the fp32_modules candidates; the fixes still run to verify
    numerics = for_doctor(args.overrides, doctor.low) if overflowed else None
    if args.search_fp32 and overflowed and s.pitfall.name != PitfallName.half_model:
        search = doctor.search_fp32(list(s.precision.fp32_modules), probes["autocast+scaler"])
    candidates = tuple(numerics["fp32_candidates"]) if numerics else ()
    advice = Advice(s, args.steps, doctor.low, doctor.user_scaled, candidates)
    fp32_set = search["fp32_modules"] if search and search["found"] else None
    recs = recommend(probes, advice, fp32_set, applied_by(args.overrides, s))
    next_line = verify(doctor, recs, probes, advice, args.budget)
    for rec in recs:
        rec["command"] = command(args.overrides, rec["override"]) if rec["override"] else None
    check = probes.get(mechanism.NAME)
    scaler_check = mechanism.observed(check) if check and not check.crashed else None
    print_report(console, doctor.health, probes, recs, search, scaler_check)
    if numerics and any(r["cause"] == "forward_overflow" for r in recs):
        console.print(escape(numerics_line(numerics)), soft_wrap=True)
    if next_line:  # no fix verified: what to run next, and why the doctor did not
        console.print(escape(next_line), soft_wrap=True)
    report = {
        "overrides": args.overrides,
        "steps": args.steps,
        "output_dir": str(out),
        "user_probe": user_probe(probes, advice).name,
        "probes": {n: probe_record(p, probes["fp32"], doctor.health) for n, p in probes.items()},
        "recommendations": recs,
        "next": next_line,
        "search_fp32": search,
        "numerics": numerics,
        "scaler_check": scaler_check,
    }
    out.mkdir(parents=True, exist_ok=True)
    strict = strict_json(report, lambda _: None)  # nan/inf (a diverged loss) as null
    (out / "doctor.json").write_text(json.dumps(strict, indent=2, default=str, allow_nan=False))
    console.print(f"wrote {out / 'doctor.json'}")
    return report
