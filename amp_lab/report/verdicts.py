"""Run health read from the metrics, and one verdict sentence per comparison group.

The thresholds are stated once (THRESHOLDS, printed in every report); every word of a verdict
follows from them and the numbers: "bf16 matches fp32 (Δacc +0.1 ± 0.3 pp, 3 seeds; loss within
0.4%), 1.9× faster, 37% less memory; fp16 diverged at step 420 (scale collapsed to 2^-14)".
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from amp_lab.report.figures import Comparison, Stat
from amp_lab.report.groups import Cell, Group
from amp_lab.report.runs import RunData

THRESHOLDS: dict[str, float] = {
    # accuracy "matches" within 1 pp, or within 2 std of the paired Δ when seeds say it is noisier
    "acc_pp": 1.0,
    "acc_noise_std": 2.0,
    "loss_rel": 0.02,  # final val loss within 2% of the reference's
    "speed_band": 0.05,  # speed-ups within ±5% are "the same speed" (timer noise)
    "memory_band": 0.05,  # memory within ±5% is "the same memory"
    "skip_rate": 0.10,  # more than 10% of steps skipped: unstable, not the scaler settling
    "stall": 0.02,  # train loss over the last quarter less than 2% below the first quarter's
    "rise": 0.05,  # ... or more than 5% above it: rising
    "min_records": 4,  # fewer train records than this: too short to call stalled or rising
}
RULES = (
    f"Thresholds: a mode *matches* its reference when |Δacc| ≤ {THRESHOLDS['acc_pp']:g} pp "
    f"(or ≤ {THRESHOLDS['acc_noise_std']:g} std of the paired Δ over seeds, if larger) and "
    f"|Δloss| ≤ {THRESHOLDS['loss_rel']:.0%} of the reference's val loss; it *is better* or "
    "*worse* when accuracy or loss is past its threshold and the other is not the opposite, "
    "else it *differs*; speed and memory "
    f"within ±{THRESHOLDS['speed_band']:.0%} are *the same*; a run is *unstable* above "
    f"{THRESHOLDS['skip_rate']:.0%} skipped steps, *stalled* when its train loss over the "
    f"last quarter is less than {THRESHOLDS['stall']:.0%} below the first quarter's, "
    f"*rising* when more than {THRESHOLDS['rise']:.0%} above, *diverged* when it stopped "
    "on non-finite steps or its last loss is not finite."
)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _divergence(run: RunData) -> str | None:
    """'diverged at step N (scale collapsed to 2^k)' when the run diverged, else None."""
    losses = [(r.get("step"), r.get("train/loss")) for r in run.train if "train/loss" in r]
    nonfinite_end = bool(losses) and not _finite(losses[-1][1])
    if not (run.summary.get("diverged") or run.status == "diverged" or nonfinite_end):
        return None
    first = ((run.summary.get("diagnostics") or {}).get("nonfinite") or {}).get("first_step")
    step = (
        first
        or next((s for s, loss in losses if not _finite(loss)), None)
        or run.summary.get("steps")
    )
    text = f"diverged at step {step}" if step is not None else "diverged"
    scales = [r["amp/loss_scale"] for r in run.train if _finite(r.get("amp/loss_scale"))]
    init = (run.summary.get("scaler") or {}).get("init_scale")
    scaled = any(s != 1.0 for s in scales)  # a run without loss scaling logs a scale of 1
    if scaled and _finite(init) and min(scales) < init and min(scales) > 0:
        text += f" (scale collapsed to 2^{math.log2(min(scales)):.0f})"
    return text


def _trend(run: RunData) -> str | None:
    """'loss stalled' or 'loss rising' from the train loss, or None (falling, or too short)."""
    losses = [r["train/loss"] for r in run.train if _finite(r.get("train/loss"))]
    if len(losses) < THRESHOLDS["min_records"]:
        return None
    quarter = max(1, len(losses) // 4)
    first, last = statistics.fmean(losses[:quarter]), statistics.fmean(losses[-quarter:])
    if last > first * (1 + THRESHOLDS["rise"]):
        return f"loss rising ({first:.3g} → {last:.3g})"
    if last > first * (1 - THRESHOLDS["stall"]):
        return f"loss stalled ({first:.3g} → {last:.3g})"
    return None


def health(run: RunData) -> list[str]:
    """What is wrong with the run, read from its status and metrics; empty when healthy."""
    if run.status not in ("completed", "diverged"):
        return [run.status]
    if divergence := _divergence(run):
        return [divergence]
    problems = []
    skipped, steps = run.summary.get("skipped_steps"), run.summary.get("steps")
    if _finite(skipped) and _finite(steps) and steps and skipped / steps > THRESHOLDS["skip_rate"]:
        problems.append(f"unstable: skipped {skipped} of {steps} steps ({skipped / steps:.0%})")
    if trend := _trend(run):
        problems.append(trend)
    return problems


def _pp(stat: Stat) -> str:
    """Δacc in percentage points: `+0.1 ± 0.3 pp, 3 seeds`."""
    assert stat.mean is not None
    text = f"{stat.mean * 100:+.1f}"
    if stat.n > 1 and stat.std is not None:
        text += f" ± {stat.std * 100:.1f} pp, {stat.n} seeds"
    else:
        text += " pp" + ("" if stat.paired else ", unpaired")
    return text


def accuracy_words(value: str, ref: str, comp: Comparison) -> str:
    """The accuracy-and-loss clause of a verdict, by THRESHOLDS."""
    acc, rel = comp.acc, comp.loss_rel
    if acc.mean is None:
        return f"{value}: no val accuracy to compare with {ref}"
    limit = max(THRESHOLDS["acc_pp"] / 100, THRESHOLDS["acc_noise_std"] * (acc.std or 0.0))
    acc_ok = abs(acc.mean) <= limit
    loss_ok = rel is None or abs(rel) <= THRESHOLDS["loss_rel"]
    loss = (
        ""
        if rel is None
        else (f"; loss within {abs(rel) * 100:.2g}%" if loss_ok else f"; loss {rel * 100:+.2g}%")
    )
    # each of accuracy and loss is -1 (worse), 0 (within its threshold) or +1 (better)
    acc_sign = 0 if acc_ok else (1 if acc.mean > 0 else -1)
    loss_sign = 0 if loss_ok or rel is None else (-1 if rel > 0 else 1)
    if acc_sign == loss_sign == 0:
        verb = "matches"
    elif acc_sign * loss_sign < 0:
        verb = "differs from"  # one better, the other worse
    else:
        verb = "is better than" if acc_sign + loss_sign > 0 else "is worse than"
    noise = "; one seed: noise unknown" if verb != "matches" and acc.n < 2 else ""
    return f"{value} {verb} {ref} (Δacc {_pp(acc)}{loss}{noise})"


def _speed_words(comp: Comparison) -> str:
    words = []
    if comp.speedup is not None:
        if abs(comp.speedup - 1) <= THRESHOLDS["speed_band"]:
            words.append("the same speed")
        else:
            words.append(f"{comp.speedup:.2g}× " + ("faster" if comp.speedup > 1 else "the speed"))
    if comp.memory_ratio is not None and abs(comp.memory_ratio - 1) > THRESHOLDS["memory_band"]:
        change = 1 - comp.memory_ratio
        words.append(f"{abs(change):.0%} {'less' if change > 0 else 'more'} memory")
    return ", ".join(words)


def cell_verdict(cell: Cell, ref: Cell, comp: Comparison, speed_ok: bool) -> str:
    """One clause for a non-reference cell: its problems, else its accuracy (and speed)."""
    problems = sorted({p for run in cell.runs for p in health(run)})
    if problems and all(health(run) for run in cell.runs):
        figures = "" if comp.acc.mean is None else f" (Δacc {_pp(comp.acc)} vs {ref.value})"
        return f"{cell.value} {', '.join(problems)}{figures}"
    clause = accuracy_words(cell.value, ref.value, comp)
    if speed_ok and (speed := _speed_words(comp)):
        clause += f", {speed}"
    if problems:
        clause += (
            f" (but {', '.join(problems)} in {sum(bool(health(r)) for r in cell.runs)} "
            f"of {len(cell.runs)} runs)"
        )
    return clause


def group_verdict(group: Group, comps: dict[str, Comparison], speed_ok: bool) -> str:
    """The group's sentence: every cell against the reference, or why there is none."""
    ref = group.reference
    if ref is None:
        named = [
            f"{c.value} {', '.join(sorted({p for r in c.runs for p in health(r)}))}"
            for c in group.cells
            if any(health(r) for r in c.runs)
        ]
        note = group.reference_note
        return "; ".join([note[:1].upper() + note[1:], *named]) + "."
    clauses = [cell_verdict(c, ref, comps[c.value], speed_ok) for c in group.cells if c is not ref]
    ref_problems = sorted({p for run in ref.runs for p in health(run)})
    if ref_problems:
        clauses.append(f"the reference {ref.value} itself: {', '.join(ref_problems)}")
    if not clauses:
        return f"Only the reference ({ref.value}) in this group: nothing to compare."
    return "; ".join(clauses) + "."
