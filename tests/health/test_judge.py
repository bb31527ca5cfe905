"""One judge on real runs: each rule's case decided once and read the same by summary.json, the
console, report.json and the doctor; a stuck run stops; seed noise is not a finding."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers import settings
from helpers.reports import report, run
from helpers.resume import interrupt
from rich.console import Console

from amp_lab.build import build
from amp_lab.config import HealthConfig
from amp_lab.health.rules import RULES, rule_names, words_of
from amp_lab.tools.doctor.diagnose import verdict_table
from amp_lab.tools.doctor.verdict import Probe, verdict
from amp_lab.trainer import Trainer

TINY = [
    "data.img_size=8",
    "trainer.batch_size=8",
    "data.val_fraction=0.05",
    "+model.kwargs.depth=1",
]
STEPS = ["trainer.max_steps=20", "trainer.log_every=5"]

# one real run per rule that a tiny model can show on a CPU in seconds
CASES = {
    "underflow": ["precision=fp16_noscale", "fault.loss_multiplier=1e-6", "diagnostics.every=0"],
    "loss_rises": ["lr.base=1"],
    # the same 64 samples every step, a model that does not move: the loss stays flat
    "loss_stalls": [
        *("data=synthetic", "data.num_samples=80", "trainer.batch_size=64"),
        *("lr.base=1e-9", "health.min_steps=10"),
    ],
    "skips": ["precision=fp16", "scaler.init_scale=16777216"],  # 8 backoffs to 2^16
    "scale_pinned": ["precision=fp16", "pitfall=no_scaler_update", "fault.inf_grad_at_step=3"],
    "diverged": ["precision=fp16", "fault.overflow_module=blocks.0.mlp.fc2"],
}


def _fit(out, *overrides: str) -> dict:
    return Trainer(build(settings(*TINY, *STEPS, *overrides), out)).fit()


@pytest.mark.slow
def test_every_surface_reports_the_judges_findings_in_the_same_words(tmp_path, caplog):
    """Each case run once; summary.json, the console's end line, report.json (run and cell) and
    the doctor's table and doctor.json all carry the run's own findings, word for word."""
    sweep = tmp_path / "sweep"
    summaries = {}
    with caplog.at_level(logging.INFO, logger="amp_lab.trainer"):
        for rule, overrides in CASES.items():
            summaries[rule] = json.loads(
                (
                    run(sweep, rule, *TINY, *STEPS[1:], *overrides, steps=20) / "summary.json"
                ).read_text()
            )
    for rule, summary in summaries.items():
        assert rule in rule_names(summary), (rule, summary["health"])
        words = words_of(summary)
        assert f"run health: {'; '.join(words)}" in caplog.text  # the console's end line
    # every setting that tells the cases apart on the axis: each run its own cell
    data = report(str(sweep), "--by", "lr,precision,fault,pitfall,scaler,health,diagnostics")
    by_name = {r["label"]: r for r in data["runs"]}
    for rule, summary in summaries.items():
        assert by_name[rule]["health"] == words_of(summary)
    for group in data["groups"]:
        for cell in group["cells"]:
            [label] = cell["runs"]
            assert cell["health"] == words_of(summaries[label])
    probes = {
        rule: Probe(rule, CASES[rule], summary=summary) for rule, summary in summaries.items()
    }
    probes["fp32"] = probes["loss_rises"]  # the table's baseline column
    table = verdict_table(probes, HealthConfig(), 80)
    assert table.columns[0]._cells[1] == "health"
    health = {column.header: column._cells[1] for column in table.columns[1:]}
    for rule, summary in summaries.items():
        assert health[rule] == "; ".join(words_of(summary))
    # as many probes as the doctor runs, on an 80-column terminal: every probe's name and
    # verdict whole (eleven measures side by side squeezed six columns to nothing)
    shown = {name: probes[name] for name in ["fp32", "underflow", "scale_pinned", "diverged"]}
    console = Console(width=80, record=True)
    console.print(verdict_table(shown, HealthConfig(), console.width))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    header = next(line for line in lines if line.startswith("┃ probe"))
    assert [cell.strip() for cell in header.strip("┃ ").split("┃")] == ["probe", *shown]
    verdicts = next(line for line in lines if line.startswith("│ verdict"))
    expected = [verdict(probe, probes["fp32"], HealthConfig()) for probe in shown.values()]
    assert [cell.strip() for cell in verdicts.strip("│ ").split("│")] == ["verdict", *expected]


@pytest.mark.slow
def test_the_doctors_probes_report_their_own_findings(tmp_path):
    """A real doctor run: each probe's doctor.json health is its summary.json's."""
    from amp_lab.tools.doctor.cli import main

    out = tmp_path / "doctor"
    assert main([*TINY, "model=test_vit", "lr.base=1", "--steps", "24", "--out", str(out)]) == 0
    report = json.loads((out / "doctor.json").read_text())
    for name, probe in report["probes"].items():
        on_disk = json.loads((out / "probes" / name / "summary.json").read_text())
        assert probe["health"] == words_of(on_disk)
    assert "loss_rises" in rule_names(report["probes"]["fp32"]["summary"])


@pytest.mark.slow
def test_a_run_stuck_on_skipped_steps_ends_diverged_with_its_reason(tmp_path):
    """A forward that is non-finite at any scale: every step skips. After health.max_bad_steps
    of them the run stops, diverged, and says why, long before its last step."""
    summary = _fit(
        tmp_path,
        "precision=fp16",
        "fault.overflow_module=blocks.0.mlp.fc2",
        "trainer.max_steps=200",
        "trainer.log_every=2",
        "health.max_bad_steps=4",
    )
    assert summary["status"] == "diverged" and summary["steps"] == 4
    [finding] = summary["health"]
    assert finding["words"] == "diverged at step 1 (loss scale fell to 2^12)"  # 4 backoffs
    assert "4 consecutive skipped steps (>= health.max_bad_steps=4)" in finding["evidence"]


@pytest.mark.slow
def test_a_final_window_all_nonfinite_ends_diverged_however_long(tmp_path):
    """Every loss nan (a forward overflow), far fewer steps than health.max_bad_steps."""
    summary = _fit(
        tmp_path,
        "precision=fp16",
        "fault.overflow_module=blocks.0.mlp.fc2",
        "trainer.max_steps=12",
        "trainer.log_every=4",
        "health.max_bad_steps=1000",
    )
    assert summary["status"] == "diverged" and summary["diverged"] is True
    assert rule_names(summary) == {"diverged"}
    assert "every loss of the last 12 steps is inf/nan" in summary["health"][0]["evidence"]


@pytest.mark.slow
def test_a_resumed_run_keeps_its_health_history(tmp_path):
    """Findings and windows are part of the checkpoint: a run stopped after its first finding
    and resumed reports exactly what the uninterrupted run reports, once."""
    overrides = [*CASES["underflow"], "checkpoint.every_minutes=0"]
    whole = _fit(tmp_path / "whole", *overrides)
    interrupt(tmp_path / "resumed", [*TINY, *STEPS, *overrides], at_step=10)
    resumed = _fit(tmp_path / "resumed", *overrides)
    assert resumed["health"] == whole["health"] and rule_names(whole) == {"underflow"}


@pytest.mark.parametrize("extra", [[], ["fault.inf_grad_at_step=3"]], ids=["clean", "one_inf"])
def test_a_healthy_run_and_one_transient_skip_raise_no_alarm(tmp_path, extra):
    summary = _fit(
        tmp_path, "precision=fp16", "trainer.max_steps=12", "diagnostics.every=4", *extra
    )
    assert summary["health"] == [] and summary["status"] == "completed"
    assert summary["skipped_steps"] == (1 if extra else 0)


def _two_seed_sweep(root, lr: str, *extra: str) -> dict:
    """fp32 and fp16_noscale (with `extra`), seeds 0 and 1, then its report."""
    for i, (precision, seed) in enumerate(
        [(p, s) for p in ("fp32", "fp16_noscale") for s in (0, 1)]
    ):
        run(
            root,
            f"{i}_precision={precision},trainer.seed={seed}",
            *TINY,
            f"precision={precision}",
            f"trainer.seed={seed}",
            "trainer.log_every=10",
            "diagnostics.every=10",  # a probe (the zero-gradient share) every log step
            f"lr.base={lr}",
            *(extra if precision != "fp32" else []),
            steps=40,
        )
    return report(str(root), "--by", "precision,fault")  # the fault moves with the mode


@pytest.mark.slow
def test_two_seeds_inside_their_noise_are_inconclusive_and_a_real_effect_is_worse(tmp_path):
    """Without a fault, fp16 without a scaler ends within a few points of fp32, one seed up and
    one down by a different amount: its Δ stands inside the seeds' noise (2 seeds: a wide
    interval), so the report says so instead of better or worse.
    With its gradients underflowing (loss x 1e-6) it learns nothing: worse, beyond that noise."""
    # a high LR: each mode's trajectory parts ways with fp32's, by a different amount per seed
    [noise] = _two_seed_sweep(tmp_path / "noise", "1e-2")["groups"]
    [cell] = [c for c in noise["cells"] if not c["reference"]]
    assert cell["delta"]["verdict"] == "inconclusive"
    assert "fp16_noscale vs fp32: inconclusive: 2 seeds, noise ±" in noise["verdict"]
    [effect] = _two_seed_sweep(tmp_path / "effect", "3e-3", "fault.loss_multiplier=1e-6")["groups"]
    [cell] = [c for c in effect["cells"] if not c["reference"]]
    assert cell["delta"]["verdict"] == "worse", effect["verdict"]
    assert "is worse than precision=fp32 loss_multiplier=1 (" in effect["verdict"]
    assert cell["health"] == ["underflow in 2 of 2 seeds"]
    words = f"{cell['value']}: underflow in 2 of 2 seeds; is worse than"
    assert effect["verdict"].startswith(words)


def test_every_rule_is_documented():
    text = (Path(__file__).parents[2] / "docs" / "diagnostics.md").read_text()
    for name in RULES:
        assert f"`{name}`" in text, name
