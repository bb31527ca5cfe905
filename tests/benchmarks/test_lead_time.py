"""The lead-time bench: divergence as it defines it, a real diverging case, and its table."""

from __future__ import annotations

import math

import pytest

from benchmarks.lead_time import (
    BASE,
    EVERY_STEP,
    PHENOMENA,
    CaseResult,
    divergence_step,
    healthy_studies,
    main,
    run_case,
    study_jobs,
    table,
)


def test_divergence_is_a_non_finite_loss_or_a_mean_above_twice_the_lowest_and_half_the_first():
    losses = [(1, 2.3), (2, 2.0), (3, 1.0), (4, 1.0), (5, 2.5), (6, 1.0)]
    assert divergence_step(losses, smooth=1) == 5  # 2.5 > 2 x 1.0
    assert divergence_step(losses, smooth=2) is None  # one batch: (1.0 + 2.5) / 2 < 2 x 1.0
    rising = [*losses, (7, 4.0), (8, 4.0)]
    assert divergence_step(rising, smooth=2) == 7  # (1.0 + 4.0) / 2 > 2 x 1.0 (steps 3-4)
    assert divergence_step([(1, 2.3), (2, math.nan)], smooth=5) == 2  # at once, unsmoothed
    trained = [(1, 2.3), (2, 0.05), (3, 0.12)]  # twice the lowest, far below half the first
    assert divergence_step(trained, smooth=1) is None


@pytest.mark.slow
def test_a_diverging_case_gives_each_warning_its_lead(tmp_path):
    """fp16 Adam moments: eps 1e-8 is 0 in fp16; the warning is judged at the first step, the
    run's loss turns non-finite a few steps later (docs/diagnostics.md's table)."""
    case = run_case(
        "fp16_state_eps",
        [*BASE, *EVERY_STEP, "trainer.max_steps=8", "optim.state_dtype=fp16", "lr.base=3e-3"],
        tmp_path,
    )
    assert case.warned["eps_lost"] == 1 and case.diverged_at is not None
    assert case.lead == case.diverged_at - 1 > 0
    healthy = CaseResult("quiet", [], None)
    grid = table([case], [healthy])
    columns = [column.header for column in grid.columns]
    row = dict(zip(columns, [column._cells[0] for column in grid.columns]))
    assert row["case"] == "fp16_state_eps" and row["diverged at"] == str(case.diverged_at)
    assert row["eps_lost"] == str(case.lead) and row["decay_lost"] == "-"  # fp32 weights
    alarms = dict(zip(columns, [column._cells[-1] for column in grid.columns]))
    assert alarms["case"] == "false alarms (of 1 healthy)" and alarms["any"] == "0"


def test_the_healthy_runs_are_each_studys_seed_0_jobs_probed_at_every_log_step():
    assert not set(PHENOMENA) & set(healthy_studies()) and "scaler_grid" in healthy_studies()
    jobs = study_jobs("scaler_grid")
    assert len(jobs) == 6  # 3 init_scale x 2 growth_interval
    assert all("trainer.seed=0" in job and "diagnostics.every=10" in job for job in jobs)


def test_a_bad_override_is_one_line_before_any_case_runs(tmp_path, capsys):
    assert main(["--set", "health.attn_logit=x", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "health.attn_logit=x is not a valid float" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_finished_case_is_read_back_and_one_with_other_settings_runs_again(tmp_path):
    tiny = [*BASE, "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0"]
    first = run_case("case", tiny, tmp_path)
    metrics = tmp_path / "case" / "metrics.jsonl"
    written = metrics.stat().st_mtime_ns
    assert run_case("case", tiny, tmp_path) == first and metrics.stat().st_mtime_ns == written
    run_case("case", [*tiny, "health.attn_logit=50"], tmp_path)
    assert metrics.stat().st_mtime_ns != written
