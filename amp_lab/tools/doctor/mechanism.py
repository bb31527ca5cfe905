"""The active scaler probe: the user's step with an overflow injected and a short growth interval,
so the run's own signatures (diagnostics/scale_events.py) name a misused scaler in a few steps."""

from __future__ import annotations

from typing import Any

from amp_lab.diagnostics.scale_events import MULTI_UPDATE, NO_UPDATE
from amp_lab.tools.doctor.verdict import Probe

NAME = "scaler_check"
# step 2: the scale has been used once before the overflow, and the step after it is clean
INJECT_STEP = 2
# 3 clean steps per growth: a correct scaler grows at INJECT_STEP + 3 and + 6; updated per
# micro-batch (grad_accum >= 2 times a step), two growths come less than 3 steps apart (with 2,
# accumulation over 3 grew every 2 steps, like a correct scaler); never updated, it never moves
GROWTH_INTERVAL = 3
# the injected step, two growth intervals after it and one more step: the verdict is settled
STEPS = INJECT_STEP + 2 * GROWTH_INTERVAL + 1


def overrides(own: list[str]) -> list[str]:
    """The probe's overrides: the user's precision and scaler, the overflow and the interval."""
    return [
        *own,
        f"fault.inf_grad_at_step={INJECT_STEP}",
        f"scaler.growth_interval={GROWTH_INTERVAL}",
        f"trainer.max_steps={STEPS}",
    ]


def observed(probe: Probe) -> dict[str, Any]:
    """What the scaler did around the injected overflow, from the probe's per-step records."""
    rows = {r["step"]: r for r in probe.records}
    before = rows.get(INJECT_STEP - 1, {}).get("amp/loss_scale")
    at = rows.get(INJECT_STEP)
    if before is None or at is None:
        return {"injected_step": INJECT_STEP, "ran": False}
    scales = [(s, rows[s]["amp/loss_scale"]) for s in sorted(rows) if s >= INJECT_STEP]
    return {
        "injected_step": INJECT_STEP,
        "ran": True,
        "skipped": at["amp/skipped_steps"] > rows[INJECT_STEP - 1]["amp/skipped_steps"],
        "scale_before": before,
        "scale_after": at["amp/loss_scale"],
        "grew_at": [s for (s, new), (_, old) in zip(scales[1:], scales) if new > old],
        "growth_interval": GROWTH_INTERVAL,
    }


def signatures(probe: Probe) -> dict[str, str]:
    """The check's scaler signatures. A skip that kept the scale means update() never runs only if
    the scale never grew either: per micro-batch updates' growths can cancel a step's backoff."""
    found = dict(probe.diag.get("signatures", {}))
    if NO_UPDATE in found and (MULTI_UPDATE in found or observed(probe).get("grew_at")):
        del found[NO_UPDATE]
    return found


def describe(seen: dict[str, Any]) -> str:
    """One line for the report: `inf at step 2: skipped, scale 65536 -> 32768, grew at 4, 6`."""
    if not seen.get("ran"):
        return f"inf at step {seen['injected_step']}: the probe did not reach it"
    grew = seen["grew_at"]
    return (
        f"inf injected at step {seen['injected_step']}: "
        f"{'skipped' if seen['skipped'] else 'NOT skipped'}, scale {seen['scale_before']:g} -> "
        f"{seen['scale_after']:g}, "
        + (f"grew at steps {', '.join(map(str, grew))} " if grew else "never grew ")
        + f"(scaler.growth_interval={seen['growth_interval']} in this probe)"
    )
