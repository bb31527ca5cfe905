"""The numbers of a comparison: per-cell figures over seeds, and deltas against the reference,
paired by seed so that noise common to both cancels (no seed in common: the difference of the
means, `paired: false`, no verdict). Whether a Δ is a finding is health/compare.py's call."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from amp_lab.config import HealthConfig
from amp_lab.health.compare import BETTER, MATCHES, WORSE, Difference, combine, paired
from amp_lab.tools.report.groups import Cell
from amp_lab.tools.report.runs import RunData

NO_DIFFERENCE = Difference(None, None, 0, None)

# summary.json keys shown per cell (mean ± std over its seeds): the section of summary.json that
# holds each (None: its top level)
FIGURES = {
    "final_val_acc": None,
    "best_val_acc": None,
    "final_val_loss": None,
    "steps_to_target": None,
    "time_to_target_s": None,
    "mean_samples_per_s": None,
    "peak_memory_mb": None,
    "param_bytes": None,
    "grad_bytes": None,
    "optimizer_state_bytes": None,
    "skipped_steps": None,
    "final_loss_scale": None,
    "low_precision_share": "precision_audit",
    "unmoved_share": "diagnostics",  # 16-bit weights that never moved (pure modes)
    "weight_norm_ratio": "diagnostics",  # their norm at the end over their norm at the start
    "attn_logit_max": "diagnostics",  # the largest attention logit of the run's probes
}
VERDICT_NAMES = {BETTER: "better", MATCHES: "matches", WORSE: "worse", "differs": "differs"}


@dataclass
class Stat:
    """Mean, sample standard deviation (0 for one value) and count of the known values."""

    mean: float | None
    std: float | None
    n: int
    paired: bool = True

    @classmethod
    def of(cls, values: Sequence[object]) -> Stat:
        # a diverged run's nan/inf is left out: its health says what happened
        known = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        if not known:
            return cls(None, None, 0)
        std = statistics.stdev(known) if len(known) > 1 else 0.0
        return cls(statistics.fmean(known), std, len(known))


def figures(runs: list[RunData]) -> dict[str, Stat]:
    """Each of FIGURES over the runs that have it."""
    stats = {}
    for key, part in FIGURES.items():
        sections = [(run.summary.get(part) or {}) if part else run.summary for run in runs]
        stats[key] = Stat.of([section.get(key) for section in sections])
    return stats


def _mean(runs: list[RunData], key: str) -> float | None:
    return Stat.of([run.summary.get(key) for run in runs]).mean


def _pairs(runs: list[RunData], refs: list[RunData], key: str) -> list[float]:
    """`key` of each run minus the reference's completed run of its seed (finite pairs only)."""
    ref_by_seed = {run.seed: run.summary.get(key) for run in refs}
    pairs = [(run.summary.get(key), ref_by_seed.get(run.seed)) for run in runs]
    return [
        a - b
        for a, b in pairs
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(a - b)
    ]


def _delta(runs: list[RunData], refs: list[RunData], key: str) -> Stat:
    """The paired Δ over the seeds; with no seed in common, the difference of the means."""
    paired = _pairs(runs, refs, key)
    if paired:
        return Stat.of(paired)
    mine = Stat.of([run.summary.get(key) for run in runs])
    theirs = _mean(refs, key)
    if mine.mean is None or theirs is None:
        return Stat(None, None, 0, False)
    return Stat(mine.mean - theirs, None, mine.n, paired=False)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass
class Comparison:
    """A cell against its group's reference (all None when the group has none)."""

    acc: Stat  # Δ final val accuracy (fraction; the report shows percentage points)
    loss: Stat  # Δ final val loss
    loss_rel: float | None  # mean Δloss / the reference's mean val loss
    speedup: float | None  # mean samples/s / the reference's
    memory_ratio: float | None  # mean peak memory / the reference's
    # the judge's verdicts on the paired Δ (amp_lab/health/compare.py); loss relative to the
    # reference's mean val loss, lower is better
    acc_interval: Difference = NO_DIFFERENCE
    loss_rel_interval: Difference = NO_DIFFERENCE

    @property
    def verdict(self) -> int | str | None:
        """BETTER, MATCHES, WORSE, `differs`, or None: inconclusive (always so unpaired)."""
        if not self.acc.paired:
            return None
        return combine(self.acc_interval.sign, self.loss_rel_interval.sign)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": VERDICT_NAMES.get(self.verdict, "inconclusive")}


def compare(cell: Cell, ref: Cell | None, cfg: HealthConfig) -> Comparison:
    """The cell's deltas, ratios and verdicts against `ref`."""
    if ref is None:
        return Comparison(Stat(None, None, 0), Stat(None, None, 0), None, None, None)
    refs = [run for run in ref.runs if run.ok]
    runs = refs if cell is ref else cell.runs  # the reference against its own completed runs
    loss = _delta(runs, refs, "final_val_loss")
    ref_loss = _mean(refs, "final_val_loss")
    loss_rel = [d / ref_loss for d in _pairs(runs, refs, "final_val_loss")] if ref_loss else []
    return Comparison(
        acc=_delta(runs, refs, "final_val_acc"),
        loss=loss,
        loss_rel=_ratio(loss.mean, ref_loss),
        speedup=_ratio(_mean(runs, "mean_samples_per_s"), _mean(refs, "mean_samples_per_s")),
        memory_ratio=_ratio(_mean(runs, "peak_memory_mb"), _mean(refs, "peak_memory_mb")),
        acc_interval=paired(_pairs(runs, refs, "final_val_acc"), cfg.acc_pp / 100, cfg),
        loss_rel_interval=paired(loss_rel, cfg.loss_rel, cfg, higher_is_better=False),
    )
