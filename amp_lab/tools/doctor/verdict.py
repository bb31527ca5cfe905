"""What the doctor concludes from one probe: its own health findings, then its loss against the
fp32 baseline's under the user's `health.*` thresholds."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from amp_lab.config import HealthConfig
from amp_lab.health.rules import rule_names, words_of


@dataclass
class Probe:
    """One short run: its loss per step and what its diagnostics saw."""

    name: str
    overrides: list[str]
    losses: list[float] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    unavailable: str | None = None  # why this device or config cannot run it
    crashed: str | None = None  # the error that ended it

    def mean(self, key: str) -> float | None:
        values = [r[key] for r in self.records if r.get(key) is not None and math.isfinite(r[key])]
        return statistics.median(values) if values else None

    @property
    def diag(self) -> dict[str, Any]:
        return self.summary.get("diagnostics") or {}

    @property
    def first_event(self) -> dict[str, Any] | None:
        """The first non-finite event: its step and the first module (and phase) inf/nan there."""
        nf = self.diag.get("nonfinite") or {}
        if not nf.get("first_step"):
            return None
        return {
            "step": nf["first_step"],
            **{k: nf.get(k) for k in ("module", "phase", "dtype", "max_abs")},
        }

    @property
    def overflow(self) -> dict[str, Any] | None:
        """The first non-finite event when it is in the forward pass (no loss scale fixes it)."""
        event = self.first_event
        return event if event and event["phase"] == "forward" else None

    @property
    def forward(self) -> dict[str, Any] | None:
        """The first non-finite value of the forward pass (its module), or None."""
        return (self.diag.get("nonfinite") or {}).get("forward")

    @property
    def skip_rate(self) -> float:
        return self.summary.get("skipped_steps", 0) / max(1, self.summary.get("steps", 1))

    @property
    def findings(self) -> set[str]:
        """The health rules that fired in this probe (its own judge's)."""
        return rule_names(self.summary)

    @property
    def health(self) -> list[str]:
        """Its findings in the judge's words, as summary.json and the report show them."""
        return words_of(self.summary)

    @property
    def flushed(self) -> float | None:
        """Share of gradient elements that are exactly zero (flushed on the way, or dead)."""
        return self.mean("diag/grad_zero_share")

    @property
    def would_flush(self) -> float | None:
        """Share of nonzero gradient elements fp16 would flush at this probe's loss scale."""
        return self.mean("diag/grad_flush_scaled_share")

    def curve(self, digits: int = 3) -> str:
        """The loss's first and last values, `2.3 -> 0.41`."""
        if not self.losses:
            return "n/a"
        return f"{self.losses[0]:.{digits}g} -> {self.losses[-1]:.{digits}g}"

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
        return statistics.mean(
            abs(a - b) / abs(b) if math.isfinite(a) else math.inf for a, b in pairs
        )


# health rules (amp_lab/health/rules.py) -> verdict, most severe first
HEALTH_VERDICTS = [
    ({"diverged"}, "diverged"),
    ({"underflow"}, "underflow"),
    ({"loss_rises"}, "rises"),
    ({"skips", "skip_burst", "not_training", "scale_collapse", "scale_pinned"}, "skips"),
    ({"loss_stalls"}, "stalls"),
]
TRAINS = ("ok", "deviates")  # a baseline that trains
# gradients underflowed, but the probe's loss tracks fp32's (within health.loss_rel): not a failure
UNHURT = "underflow, loss unhurt"
HEALTHY = ("ok", UNHURT)


def verdict(probe: Probe, base: Probe, cfg: HealthConfig) -> str:
    """The probe's own health findings first, then its loss against fp32's (`health.*`); underflow
    within `health.loss_rel` of fp32's loss is 'unhurt' unless every gradient is zero."""
    if probe.unavailable:
        return "unavailable"
    if probe.crashed:
        return "crashed"
    drop = probe.drop()
    if probe.summary.get("diverged"):  # the health judge's finding, as every surface reads it
        return "diverged"
    loss = None
    if probe is not base and drop < cfg.stall_share * base.drop() and base.drop() > cfg.base_drop:
        loss = "stalls"
    elif probe is not base and probe.deviation(base) > cfg.deviation:
        loss = "deviates"
    for found, name in HEALTH_VERDICTS:
        if probe.findings & found:
            # every gradient zero: its loss tracks fp32's only while fp32's has not moved yet
            unhurt = (
                probe is not base
                and not loss
                and probe.deviation(base) <= cfg.loss_rel
                and (probe.flushed or 0.0) < 1.0
            )
            return UNHURT if name == "underflow" and unhurt else name
    return loss or "ok"
