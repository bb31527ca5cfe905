"""The lead-time bench: divergence as it defines it, a real diverging case, and its table."""

from __future__ import annotations

import math

import pytest

from amp_lab.health.lead_time import (
    BASE,
    EVERY_STEP,
    PHENOMENA,
    CaseResult,
    divergence_step,
    healthy_studies,
    run_case,
    study_jobs,
    table,
)


def test_divergence_is_the_first_non_finite_loss_or_twice_the_lowest_before_it():
    assert divergence_step([(1, 2.3), (2, 2.0), (3, 3.9), (4, 4.1)]) == 4  # 4.1 > 2 x 2.0
    assert divergence_step([(1, 2.3), (2, math.nan)]) == 2
    assert divergence_step([(1, 2.3), (2, 2.2), (3, 2.1)]) is None


@pytest.mark.slow
def test_a_diverging_case_gives_each_warning_its_lead(tmp_path):
    """fp16 Adam moments: eps 1e-8 is 0 in fp16; the warning is judged at the first step, the
    run diverges a few steps later (docs/diagnostics.md's table)."""
    case = run_case(
        "fp16_state_eps",
        [*BASE, *EVERY_STEP, "trainer.max_steps=8", "optim.state_dtype=fp16", "lr.base=3e-3"],
        tmp_path,
    )
    assert case.warned["eps_lost"] == 1 and case.diverged_at is not None
    assert case.lead == case.diverged_at - 1 > 0
    healthy = CaseResult("quiet", [], None)
    grid = table([case], [healthy])
    rows = dict(zip(grid.columns[0]._cells, grid.columns[1]._cells))
    assert rows["eps_lost"] == str(case.lead) and rows["decay_lost"] == "-"  # fp32 weights
    assert grid.columns[-1]._cells == ["0"] * len(rows)


def test_the_healthy_runs_are_each_studys_seed_0_jobs_probed_at_every_log_step():
    assert not set(PHENOMENA) & set(healthy_studies()) and "scaler_grid" in healthy_studies()
    jobs = study_jobs("scaler_grid")
    assert len(jobs) == 6  # 3 init_scale x 2 growth_interval
    assert all("trainer.seed=0" in job and "diagnostics.every=10" in job for job in jobs)
