"""Run health: every run names its silent failures in summary.json, the log and its status."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from helpers import settings
from helpers.resume import interrupt

from amp_lab.build import build
from amp_lab.config import ConfigError, DiagnosticsConfig
from amp_lab.numerics.health import RunHealth, Window, rules
from amp_lab.trainer import Trainer

TINY = [
    "data.img_size=8",
    "trainer.batch_size=8",
    "data.val_fraction=0.05",
    "+model.kwargs.depth=1",
]


def _fit(tmp_path, *overrides: str) -> dict:
    return Trainer(build(settings(*TINY, *overrides), tmp_path)).fit()


def _health(
    windows: list[tuple[int, int, float, float]], dynamic: bool = True, **cfg: float
) -> RunHealth:
    """Windows of 10 steps: (finite, skipped, loss, scale)."""
    health = RunHealth(DiagnosticsConfig(**cfg), dynamic, 65536.0, math.log(10))
    for i, (finite, skipped, loss, scale) in enumerate(windows, 1):
        health.observe(Window(10 * i, 10, finite, skipped, loss, scale), None)
    health.finish(10 * len(windows), sum(w[1] for w in windows))
    return health


def test_a_healthy_history_has_no_finding():
    health = _health([(10, 0, 2.3 - 0.05 * i, 65536.0) for i in range(12)])
    assert health.entries == [] and "ok" in health.summary_line()


def test_each_rule_fires_on_its_evidence():
    rising = _health([(10, 0, 2.3, 65536.0), (10, 0, 9.0, 65536.0)])
    assert rules({"health": rising.entries}) == {"loss_rises"}
    flat = _health([(10, 0, 2.3, 65536.0)] * 12)  # 120 steps >= health_min_steps
    assert rules({"health": flat.entries}) == {"loss_stalls"}
    assert _health([(10, 0, 2.3, 65536.0)] * 5).entries == []  # too short to call a stall
    skips = _health([(10, 3, 2.3, 65536.0), (10, 2, 2.2, 16384.0)])
    assert rules({"health": skips.entries}) == {"skips"}  # 5/20 > 0.2
    pinned = _health([(10, 1, 2.3, 65536.0), (10, 0, 2.2, 65536.0)])
    assert rules({"health": pinned.entries}) == {"scale_pinned"}
    assert _health([(10, 1, 2.3, 65536.0), (10, 0, 2.2, 65536.0)], dynamic=False).entries == []
    collapsed = _health([(10, 1, 2.3, 0.5), (10, 0, 2.2, 0.5)])
    assert "scale_collapse" in rules({"health": collapsed.entries})
    stuck = _health([(10, 0, 2.3, 65536.0), (10, 10, 2.2, 64.0)])
    assert "final_window_skipped" in rules({"health": stuck.entries})
    dead = _health([(10, 0, 2.3, 65536.0), (0, 10, math.nan, 64.0)])
    assert "final_window_nonfinite" in rules({"health": dead.entries}) and dead.final_nonfinite()


def test_underflow_fires_on_the_zero_gradient_share():
    health = RunHealth(DiagnosticsConfig(), False, 1.0)
    assert health.observe(Window(10, 10, 10, 0, 2.3, 1.0), 0.49) == []
    (line,) = health.observe(Window(20, 10, 10, 0, 2.3, 1.0), 0.97)
    assert line.startswith("run health: underflow at step 20: 97% of gradient elements")


@pytest.mark.parametrize(
    "field, value", [("health_skip_rate", 0), ("health_rise", -1), ("health_window", 0)]
)
def test_bad_thresholds_fail_at_start_up(field, value):
    with pytest.raises(ConfigError, match=f"diagnostics.{field}"):
        settings(f"diagnostics.{field}={value}")


def test_the_silent_underflow_run_names_itself(tmp_path, caplog):
    """Issue 17: fp16 without a scaler and a 1e-6 loss had 100% zero gradients, yet ended
    `completed` with nothing said. Now the summary, the log and the end line say it."""
    with caplog.at_level(logging.INFO, logger="amp_lab.trainer"):
        summary = _fit(
            tmp_path,
            "precision=fp16_noscale",
            "fault.loss_multiplier=1e-6",
            "trainer.max_steps=20",
            "trainer.log_every=10",
            "diagnostics.every=0",
        )
    (entry,) = summary["health"]
    assert entry["rule"] == "underflow" and entry["step"] == 10
    assert "% of gradient elements are exactly zero" in entry["evidence"]
    assert "run health: underflow at step 10" in caplog.text
    assert "run health: underflow (step 10)" in caplog.text  # the end-of-run line
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["health"] == summary["health"]


def test_an_fp32_run_whose_loss_blows_up_is_named(tmp_path):
    """Issue 17: fp32 at lr.base=1 went 2.3 -> 20 and nothing said so."""
    summary = _fit(tmp_path, "lr.base=1", "trainer.max_steps=20", "trainer.log_every=10")
    assert rules(summary) == {"loss_rises"}
    assert summary["status"] == "completed"  # finite, just not training


def test_a_resumed_run_keeps_its_health_history(tmp_path):
    """Health findings and windows are part of the checkpoint: a run stopped after its first
    finding and resumed reports exactly what the uninterrupted run reports, once."""
    run = [
        "precision=fp16_noscale",
        "fault.loss_multiplier=1e-6",
        "trainer.max_steps=20",
        "trainer.log_every=5",
        "diagnostics.every=0",
        "checkpoint.every_minutes=0",
    ]
    whole = _fit(tmp_path / "whole", *run)
    interrupt(tmp_path / "resumed", [*TINY, *run], at_step=10)
    resumed = _fit(tmp_path / "resumed", *run)
    assert resumed["health"] == whole["health"] and rules(whole) == {"underflow"}


def test_a_final_window_all_nonfinite_ends_diverged_however_long(tmp_path):
    """Every loss nan (a forward overflow), far fewer steps than trainer.max_bad_steps."""
    summary = _fit(
        tmp_path,
        "precision=fp16",
        "fault.overflow_module=blocks.0.mlp.fc2",
        "trainer.max_steps=12",
        "trainer.log_every=4",
        "trainer.max_bad_steps=1000",
    )
    assert summary["status"] == "diverged" and summary["diverged"] is True
    assert {"final_window_nonfinite", "skips"} <= rules(summary)


@pytest.mark.parametrize("extra", [[], ["fault.inf_grad_at_step=3"]], ids=["clean", "one_inf"])
def test_a_healthy_run_and_one_transient_skip_raise_no_alarm(tmp_path, extra):
    summary = _fit(
        tmp_path,
        "precision=fp16",
        "trainer.max_steps=12",
        "trainer.log_every=4",
        "diagnostics.every=4",
        *extra,
    )
    assert summary["health"] == [] and summary["status"] == "completed"
    assert summary["skipped_steps"] == (1 if extra else 0)


def test_the_report_shows_each_runs_health(tmp_path, capsys):
    from amp_lab.report.compare import main as report

    for name, extra in [("fine", []), ("rising", ["lr.base=1"])]:
        Trainer(
            build(
                settings(*TINY, "trainer.max_steps=20", "trainer.log_every=10", *extra),
                tmp_path / "sweep" / name,
            )
        ).fit()
    assert report([str(tmp_path / "sweep")]) == 0
    data = json.loads((tmp_path / "sweep" / "report" / "report.json").read_text())
    found = {Path(r["path"]).name: r["summary_health"] for r in data["runs"]}
    assert found["fine"] == [] and [h.split()[0] for h in found["rising"]] == ["loss_rises"]
    md = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "- `rising`: loss_rises at step" in md
