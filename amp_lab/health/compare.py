"""What a difference between runs is worth: a paired interval over the seeds, against a threshold.

A difference is a finding only when the `health.confidence` t-interval of the paired differences
(run minus the reference run of the same seed) excludes zero and its mean passes the threshold;
it matches when the whole interval lies within the threshold; anything else, and any comparison
of fewer than two seeds, is inconclusive.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy.stats import t as student_t

from amp_lab.config import HealthConfig

BETTER, MATCHES, WORSE = 1, 0, -1


@dataclass(frozen=True)
class Difference:
    """One figure's paired difference over the seeds, judged against its threshold."""

    mean: float | None
    half_width: float | None  # of the confidence interval; None under two seeds
    n: int
    sign: int | None  # BETTER, MATCHES, WORSE, or None: inconclusive


def paired(
    deltas: Sequence[float], threshold: float, cfg: HealthConfig, higher_is_better: bool = True
) -> Difference:
    """The verdict on paired differences `deltas` (one per seed) with a threshold in their unit."""
    known = [d for d in deltas if math.isfinite(d)]
    n = len(known)
    if n == 0:
        return Difference(None, None, 0, None)
    mean = statistics.fmean(known)
    if n < 2:  # one seed: its noise is unknown
        return Difference(mean, None, 1, None)
    half = student_t.ppf((1 + cfg.confidence) / 2, n - 1) * statistics.stdev(known) / math.sqrt(n)
    low, high = mean - half, mean + half
    if -threshold <= low and high <= threshold:
        sign: int | None = MATCHES
    elif (low > 0 or high < 0) and abs(mean) > threshold:
        sign = BETTER if (mean > 0) == higher_is_better else WORSE
    else:
        sign = None
    return Difference(mean, half, n, sign)


def combine(*signs: int | None) -> int | None | str:
    """One verdict from several figures' signs: matches when all match; better or worse when one
    is and none says the opposite; `differs` when they disagree; None (inconclusive) else."""
    decided = {s for s in signs if s in (BETTER, WORSE)}
    if len(decided) == 2:
        return "differs"
    if decided:
        return decided.pop()
    return MATCHES if all(s == MATCHES for s in signs) else None
