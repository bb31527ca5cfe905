"""What the doctor concludes from its probes: a verdict per probe and ranked recommendations.

Each probe is a short run of the user's config (amp_lab/doctor.py). Its loss curve is compared
with the fp32 baseline step by step, and the diagnostics it recorded (non-finite attribution,
gradient underflow, skips, loss-scale events, pitfall signatures) are turned into recommendations,
each naming the override or the code change to try (docs/amp_pitfalls.md §5).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

STALL_SHARE = 0.4  # a probe whose loss fell by less than 40% of the baseline's fall stalls...
BASE_DROP = 0.04  # ...when the fp32 baseline fell by more than 4% over the same steps
DEVIATION = 0.15  # mean relative distance to the baseline's loss above which a probe deviates
UNDERFLOW = 0.5  # share of gradient elements flushed to zero that counts as underflow


@dataclass
class Probe:
    """One short run: its loss per step and what its diagnostics saw."""

    name: str
    overrides: list[str]
    losses: list[float] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    unavailable: str | None = None  # why the device cannot run it
    crashed: str | None = None  # the error that ended it

    def mean(self, key: str) -> float | None:
        values = [r[key] for r in self.records if r.get(key) is not None
                  and math.isfinite(r[key])]
        return statistics.median(values) if values else None

    @property
    def diag(self) -> dict[str, Any]:
        return self.summary.get("diagnostics") or {}

    @property
    def skip_rate(self) -> float:
        return self.summary.get("skipped_steps", 0) / max(1, self.summary.get("steps", 1))

    @property
    def flushed(self) -> float | None:
        """Share of gradient elements that are exactly zero (flushed on the way, or dead)."""
        return self.mean("diag/grad_zero_share")

    @property
    def would_flush(self) -> float | None:
        """Share of nonzero gradient elements fp16 would flush at this probe's loss scale."""
        return self.mean("diag/grad_flush_scaled_share")

    def drop(self) -> float:
        """Relative fall of the mean loss from the first third of the steps to the last third
        (nan: not finite); thirds, because single batches are noisy."""
        third = max(1, len(self.losses) // 3)
        head, tail = self.losses[:third], self.losses[-third:]
        if not head or not all(math.isfinite(v) for v in head + tail):
            return math.nan
        return 1.0 - statistics.mean(tail) / statistics.mean(head)

    def deviation(self, base: Probe) -> float:
        pairs = [(a, b) for a, b in zip(self.losses, base.losses) if math.isfinite(b) and b]
        if not pairs:
            return math.nan
        return statistics.mean(abs(a - b) / abs(b) if math.isfinite(a) else math.inf
                               for a, b in pairs)


def verdict(probe: Probe, base: Probe) -> str:
    """ok | diverged | skips | stalls | deviates | unavailable | crashed, against the baseline."""
    if probe.unavailable:
        return "unavailable"
    if probe.crashed:
        return "crashed"
    drop = probe.drop()
    if probe.summary.get("diverged") or math.isnan(drop):
        return "diverged"
    if probe.skip_rate > 0.25:
        return "skips"
    if probe is not base and drop < STALL_SHARE * base.drop() and base.drop() > BASE_DROP:
        return "stalls"
    if probe is not base and probe.deviation(base) > DEVIATION:
        return "deviates"
    return "ok"


@dataclass
class Advice:
    """The user's settings the recommendations adjust."""

    init_scale: float
    growth_interval: int
    lr_scale: float
    warmup_steps: int
    steps: int
    low_dtype: str  # fp16 or bf16: the autocast dtype the probes used


SIGNATURE_FIXES = {  # pitfall signature -> (score, problem, fix)
    "clip_before_unscale": (95, "gradients are clipped while still scaled",
                            "unscale before clipping: scaler.unscale_(optimizer), then "
                            "clip_grad_norm_, then scaler.step"),
    "half_model": (92, "master weights / optimizer state are not fp32",
                   "keep weights and optimizer state in fp32 (no model.half()); autocast casts "
                   "the matmuls"),
    "no_scaler_update": (90, "steps skip but the loss scale never backs off",
                         "call scaler.update() once per optimizer step, after scaler.step()"),
    "update_every_microbatch": (90, "the loss scale moves more than once per optimizer step",
                                "call scaler.update() once per optimizer step, not per "
                                "micro-batch"),
    "loss_in_low_precision": (85, "the loss is computed in low precision",
                              "compute the loss in fp32: loss_fn(logits.float(), labels)"),
}


def _rec(score: int, problem: str, evidence: str, override: str | None,
         fix: str | None = None) -> dict[str, Any]:
    return {"score": score, "problem": problem, "evidence": evidence, "override": override,
            "fix": fix}


def _forward_culprit(probes: list[Probe]) -> tuple[Probe, dict] | None:
    for probe in probes:
        forward = (probe.diag.get("nonfinite") or {}).get("forward")
        if forward:
            return probe, forward
    return None


def recommend(probes: dict[str, Probe], advice: Advice,
              fp32_set: list[str] | None = None) -> list[dict[str, Any]]:
    """Ranked recommendations, most urgent first, each with the override or fix to try."""
    base, noscale, scaled = probes["fp32"], probes["autocast"], probes["autocast+scaler"]
    bf16 = probes.get("bf16")
    low = [p for p in (scaled, noscale) if not p.unavailable and not p.crashed]
    recs: list[dict[str, Any]] = [
        _rec(75, f"the {p.name} probe crashed", p.crashed, None,
             f"see the traceback: python -m amp_lab <your overrides> {' '.join(p.overrides[-2:])}")
        for p in probes.values() if p.crashed]
    warm = max(1, advice.steps // 5)
    if verdict(base, base) != "ok":
        recs.append(_rec(100, "the fp32 baseline itself does not converge",
                         f"fp32 loss {_curve(base)}: not a precision problem",
                         f"lr.scale={advice.lr_scale / 2:g} lr.warmup_steps={warm}"))
    seen = {}
    for probe in [*low, base]:
        seen.update({k: v for k, v in probe.diag.get("signatures", {}).items() if k not in seen})
    for name, evidence in seen.items():
        score, problem, fix = SIGNATURE_FIXES[name]
        recs.append(_rec(score, problem, evidence, "pitfall=none", fix))
    culprit = _forward_culprit(low)
    if culprit:
        probe, fwd = culprit
        modules = fp32_set or [fwd["module"]]
        recs.append(_rec(80, f"{fwd['module']} overflows {fwd['dtype']} in the forward pass",
                         f"{probe.name}: first non-finite output at step {fwd['step']} in "
                         f"{fwd['module']} (max |x| {fwd['max_abs']}, fp16 max 65504)",
                         f"precision.fp32_modules=[{','.join(modules)}]"))
    flushed = noscale.flushed
    if (verdict(noscale, base) in ("stalls", "deviates") or (flushed or 0) > UNDERFLOW) and (
            verdict(scaled, base) == "ok"):
        recs.append(_rec(85, "gradients underflow without loss scaling",
                         f"{noscale.name}: {_pct(flushed)} of gradient elements are zero (fp32: "
                         f"{_pct(base.flushed)}; fp16 at scale 1 would flush "
                         f"{_pct(base.would_flush)} of them), loss {_curve(noscale)}; with the "
                         f"scaler: loss {_curve(scaled)}",
                         f"precision={advice.low_dtype} scaler.enabled=true"))
    # A forward overflow explains the skips by itself; a misused scaler (a signature) makes its
    # scale meaningless and is the fix to make first.
    if not culprit and not seen:
        recs += _scaler_recs(scaled, base, advice)
    if bf16 and not seen and not bf16.unavailable and verdict(bf16, base) == "ok" and (
            any(verdict(p, base) != "ok" for p in low) or culprit):
        recs.append(_rec(70, "fp16's range is the problem; bf16 has fp32's exponent range",
                         f"bf16 loss {_curve(bf16)} tracks fp32 ({_curve(base)})",
                         "precision=bf16"))
    if not recs:
        recs.append(_rec(0, "no numerical problem found",
                         f"{scaled.name} tracks fp32 within {_pct(scaled.deviation(base))} "
                         f"over {advice.steps} steps", None))
    return sorted(recs, key=lambda r: -r["score"])


def _scaler_recs(scaled: Probe, base: Probe, advice: Advice) -> list[dict[str, Any]]:
    recs = []
    final = scaled.summary.get("final_loss_scale") or advice.init_scale
    # skipped steps from step 1 on (the probes log every step) and none after them, or a scale
    # still above 2**16 after every step skipped: the scale started too high, the gradients
    # are fine. Counted in skips, not backoffs: a hysteresis scaler holds its first overflows.
    cumulative = [r.get("amp/skipped_steps", 0) for r in scaled.records]
    leading = next((i for i, n in enumerate(cumulative) if n != i + 1), len(cumulative))
    skipped = scaled.summary.get("skipped_steps", 0)
    if leading >= 3 and (leading == skipped or final > 2.0**16):
        recs.append(_rec(72 if scaled.skip_rate > 0.25 else 40,  # before "use bf16" (70)
                         "the initial loss scale is too high",
                         f"{leading} steps skipped from step 1: scale {advice.init_scale:g} -> "
                         f"{final:g}", f"scaler.init_scale={min(final, 2.0**16):g}"))
    elif scaled.skip_rate > 0.25 or final < 1.0:
        recs.append(_rec(60, "the loss scale keeps backing off (unstable gradients)",
                         f"{scaled.name}: {_pct(scaled.skip_rate)} of steps skipped, scale "
                         f"{advice.init_scale:g} -> {final:g}",
                         f"lr.scale={advice.lr_scale * 0.5:g} "
                         f"lr.warmup_steps={max(advice.warmup_steps * 2, advice.steps // 5)} "
                         f"scaler.growth_interval={max(5000, advice.growth_interval * 2)}"))
    elif verdict(scaled, base) == "deviates":
        recs.append(_rec(50, "the mixed-precision loss drifts from fp32",
                         f"{scaled.name}: mean |loss - fp32| / fp32 = "
                         f"{_pct(scaled.deviation(base))}",
                         f"lr.scale={min(0.7, advice.lr_scale * 0.7):g} "
                         f"lr.warmup_steps={max(advice.warmup_steps * 2, advice.steps // 5)}"))
    return recs


def _pct(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.0%}"


def _curve(probe: Probe) -> str:
    if not probe.losses:
        return "n/a"
    return f"{probe.losses[0]:.3g} -> {probe.losses[-1]:.3g}"
