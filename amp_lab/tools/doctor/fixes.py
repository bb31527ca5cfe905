"""Verified fixes: the doctor runs what it recommends before it says so (docs/diagnostics.md,
"Verified fixes")."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from amp_lab.compose import compose_settings
from amp_lab.config import AmpLabConfig, ConfigError
from amp_lab.tools.doctor.advice import Advice, baseline_fixes
from amp_lab.tools.doctor.probes import FP32, Doctor, command, key
from amp_lab.tools.doctor.verdict import HEALTHY, Probe, verdict


def _normalised(settings: AmpLabConfig) -> dict[str, Any]:
    from amp_lab.precision.modes import PRECISION_MODES

    values = asdict(settings)
    if values["scaler"]["enabled"] is None:  # None: the scaler the precision mode needs
        values["scaler"]["enabled"] = PRECISION_MODES[settings.precision.name].dynamic_scaling
    return values


def applied_by(user: list[str], settings: AmpLabConfig) -> Callable[[str], bool]:
    """A test: does the user's config already do what an override asks for?"""
    mine = _normalised(settings)

    def applied(override: str) -> bool:
        try:
            return _normalised(compose_settings([*user, *override.split()])) == mine
        except ConfigError:
            return False

    return applied


def verify(
    doctor: Doctor,
    recs: list[dict[str, Any]],
    probes: dict[str, Probe],
    advice: Advice,
    budget_s: float,
) -> str | None:
    """Verify the top recommendations while the budget lasts; the next step's line, if any."""
    deadline = time.monotonic() + budget_s
    runnable = [r for r in recs if r["override"]]
    for i, rec in enumerate(runnable, 1):
        if i > 1 and time.monotonic() > deadline:
            rec.update(verified=None, verification=f"not run (over --budget={budget_s:g} s)")
            continue
        if rec["cause"] == "baseline":
            _verify_baseline(doctor, rec, advice)
        else:
            verify_fix(doctor, rec, probes, i, deadline)
    return next_step(doctor, runnable, budget_s, advice)


def next_step(
    doctor: Doctor, runnable: list[dict[str, Any]], budget_s: float, advice: Advice
) -> str | None:
    """None when a fix is verified (or none was needed), else what to run next and why not run."""
    if not runnable or any(r.get("verified") for r in runnable):
        return None
    over = f"not run: over --budget={budget_s:g} s"
    if runnable[0]["cause"] == "baseline":  # the gentlest fixes failed: a lower LR still
        lower = baseline_fixes(advice, advice.settings.lr.scale / 10)[-1]
        return (
            f"next: {command(doctor.user, lower)} (fp32 did not train with any fix tried; "
            "this LR is below the doctor's lowest)"
        )
    # the grown set of a fix whose overflow moved follows the problem: it comes first
    grown = [r["grown"]["next"] for r in runnable if (r.get("grown") or {}).get("stopped")]
    pending = [r["override"] for r in runnable if r.get("verified") is None]
    if grown or pending:
        return f"next: {command(doctor.user, [*grown, *pending][0])} ({over})"
    return (
        f"next: {command(doctor.user, 'precision=fp32')} (every fix above was run and none "
        "verified; fp32 trains)"
    )


def verify_fix(
    doctor: Doctor,
    rec: dict[str, Any],
    probes: dict[str, Probe],
    i: int,
    deadline: float = math.inf,
) -> None:
    """Run one recommendation as probe fix_<i> of the user's config; mark it verified or not."""
    new = rec["override"].split()
    fix = doctor.run_probe(f"fix_{i}", [*doctor.own, *new])
    base = probes["fp32"]
    # a fix that changes what fp32 runs too (LR, model, optimizer, loss) is compared under it
    if any(key(o).startswith(("lr.", "model.", "optim.", "data.")) for o in new):
        base = doctor.run_probe(f"fix_{i}_fp32", [*FP32, *new])
    if rec["cause"] == "forward_overflow" and fix.overflow:
        fix = _grow(doctor, rec, fix, i, deadline)
    said = verdict(fix, base, doctor.health)
    rec["fix_probe"] = {
        "name": fix.name,
        "losses": fix.losses,
        "verdict": said,
        "health": fix.summary.get("health"),
        "deviation_from_fp32": fix.deviation(base) if fix.losses else None,
    }
    rec["verified"], rec["verification"] = _outcome(rec, fix, base, said, doctor)
    if rec.get("grown"):
        rec["verification"] += f"; {rec['grown']['said']}"


def _outcome(
    rec: dict[str, Any], fix: Probe, base: Probe, said: str, doctor: Doctor
) -> tuple[bool, str]:
    """Whether the fix probe verifies the recommendation, and the sentence that says so."""
    if fix.crashed:
        return False, f"the fix crashed: {fix.crashed}"
    if event := fix.overflow:
        moved = (
            f" moved to {event['module']}" if event["module"] != rec.get("module") else " remains"
        )
        return False, f"not verified: the overflow{moved} (step {event['step']}, forward)"
    if rec["cause"] in fix.findings:  # an early warning's fix must silence it
        return False, f"not verified: the warning remains ({'; '.join(fix.health)})"
    if said not in HEALTHY:
        return False, (
            f"not verified: with it the run {said} (loss {fix.curve()}, "
            f"health: {'; '.join(fix.health) or 'ok'})"
        )
    return True, (
        f"verified: loss {fix.curve()}, within {fix.deviation(base):.0%} of fp32 "
        f"(tolerance health.deviation={doctor.health.deviation:.0%}), "
        + ("no health finding" if said == "ok" else f"health: {'; '.join(fix.health)}")
    )


def _grow(doctor: Doctor, rec: dict[str, Any], fix: Probe, i: int, deadline: float) -> Probe:
    """Grow the set `fix` kept in fp32 by the fp32 search; the probe of the set recommended last."""
    start = rec["override"].split("=", 1)[1].strip("[]").split(",")
    search = doctor.search_fp32(
        start, fix, base=doctor.own, name=f"fix_{i}_grow", deadline=deadline
    )
    grown = search["fp32_modules"]
    sets = dict.fromkeys(f"[{','.join(t['fp32_modules'])}]" for t in search["tried"])
    steps = " -> ".join(sets)  # each set once, in the order first run
    said = (
        f"keeping [{','.join(grown)}] in fp32 is next, not run: over the budget"
        if search["stopped"]
        else f"the kept set grew {steps}"
    )
    kept = f"precision.fp32_modules=[{','.join(grown)}]"
    rec["grown"] = {
        "from": start,
        "tried": search["tried"],
        "stopped": search["stopped"],
        "next": kept,
        "said": said,
    }
    if search["found"] and grown != start:
        rec["override"] = kept
        return doctor.fp32_runs.get((tuple(doctor.own), tuple(grown))) or fix
    return fix


def _verify_baseline(doctor: Doctor, rec: dict[str, Any], advice: Advice) -> None:
    """fp32 probes of the gentlest LR/warmup/clipping fixes until one trains."""
    tried: list[dict[str, Any]] = []
    for k, candidate in enumerate(baseline_fixes(advice), 1):
        probe = doctor.run_probe(f"baseline_fix_{k}", [*FP32, *candidate.split()])
        said = verdict(probe, probe, doctor.health)  # a crashed probe's is "crashed"
        tried.append({"override": candidate, "verdict": said, "losses": probe.losses})
        if said == "ok":
            why = (
                f"verified: fp32 with {candidate} trains (loss {probe.curve()}, no health "
                "finding); then run the doctor again for the precision"
            )
            rec.update(override=candidate, verified=True, tried=tried, verification=why)
            return
    candidates = "; ".join(t["override"] for t in tried)
    why = f"not verified: fp32 still does not train with {candidates}"
    rec.update(verified=False, tried=tried, verification=why)
