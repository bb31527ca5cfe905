"""The judge's verdict on a difference between runs: a paired t-interval over the seeds."""

from __future__ import annotations

import pytest

from amp_lab.config import HealthConfig
from amp_lab.health.compare import BETTER, MATCHES, WORSE, combine, paired

CFG = HealthConfig()  # 95%


def test_the_interval_is_students_t_over_the_paired_seeds():
    diff = paired([0.01, 0.02, 0.03], threshold=0.01, cfg=CFG)
    # mean 0.02, sample std 0.01, t(0.975, 2 df) = 4.3027
    assert diff.mean == pytest.approx(0.02) and diff.n == 3
    assert diff.half_width == pytest.approx(4.302653 * 0.01 / 3**0.5, rel=1e-5)
    assert diff.sign is None  # [-0.005, 0.045]: neither inside ±0.01 nor clear of zero


@pytest.mark.parametrize(
    "deltas, sign",
    [
        ([0.002, 0.001, 0.003], MATCHES),  # the whole interval within ±1 pp
        ([-0.30, -0.32], WORSE),  # 2 seeds, a consistent effect far beyond its noise
        ([0.30, 0.32], BETTER),
        ([0.121 + 0.136, 0.121 - 0.136], None),  # the issue's +12.1 ± 13.6 pp over 2 seeds
        ([-0.05], None),  # one seed: its noise is unknown
        ([], None),
    ],
)
def test_a_difference_is_a_finding_only_outside_its_noise(deltas, sign):
    assert paired(deltas, threshold=0.01, cfg=CFG).sign == sign


def test_lower_is_better_for_the_loss():
    assert paired([0.10, 0.11, 0.12], threshold=0.02, cfg=CFG, higher_is_better=False).sign == WORSE


def test_figures_combine_into_one_verdict():
    assert combine(MATCHES, MATCHES) == MATCHES
    assert combine(WORSE, MATCHES) == WORSE and combine(WORSE, None) == WORSE
    assert combine(BETTER, WORSE) == "differs"
    assert combine(MATCHES, None) is None  # a match needs every figure to match
