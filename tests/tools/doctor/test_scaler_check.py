"""The active scaler probe (issue 35): an overflow injected at a known step and a short growth
interval show a misused GradScaler in a few steps, with the user's growth_interval of 2000 and no
overflow of their own, and leave a correct scaler unflagged."""

from __future__ import annotations

import json

import pytest
from helpers import DOCTOR_TINY

from amp_lab.tools.doctor import mechanism
from amp_lab.tools.doctor.cli import main
from amp_lab.tools.doctor.verdict import Probe

TINY = [*DOCTOR_TINY, "precision=fp16"]


def _doctor(tmp_path, *args: str) -> dict:
    assert main([*TINY, *args, "--steps", "6", "--budget", "0", "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / "doctor.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mistake", "extra", "problem"),
    [
        ("no_scaler_update", [], "steps skip but the loss scale never backs off"),
        (
            "update_every_microbatch",
            ["trainer.grad_accum=2"],
            "the loss scale moves more than once per optimizer step",
        ),
        (
            "clip_before_unscale",
            ["trainer.clip_grad=1.0"],
            "gradients are clipped while still scaled",
        ),
    ],
)
def test_each_scaler_mistake_is_named_first(tmp_path, mistake, extra, problem):
    report = _doctor(tmp_path, f"pitfall={mistake}", *extra)
    # the user's own probes ran 6 clean steps at growth_interval 2000: no symptom there
    assert report["probes"]["autocast+scaler"]["summary"]["skipped_steps"] == 0
    top = report["recommendations"][0]
    assert (top["cause"], top["problem"]) == (mistake, problem)
    assert top["override"] == "pitfall=none" and top["verified"] is True
    seen = report["scaler_check"]
    assert seen["ran"] and seen["skipped"]  # the injected overflow skipped its step
    if mistake == "no_scaler_update":
        assert seen["scale_after"] == seen["scale_before"] and seen["grew_at"] == []
        assert top["evidence"].startswith("scaler_check: step 2 skipped")


@pytest.mark.slow
def test_a_correct_scaler_with_accumulation_and_clipping_is_not_flagged(tmp_path, capsys):
    report = _doctor(tmp_path, "trainer.grad_accum=2", "trainer.clip_grad=1.0")
    assert [r["cause"] for r in report["recommendations"]] == ["none"]
    seen = report["scaler_check"]
    # backed off once at the injected step, grew back every growth_interval clean steps
    assert seen["skipped"] and seen["scale_after"] == seen["scale_before"] / 2
    start = mechanism.INJECT_STEP
    assert seen["grew_at"] == [
        start + mechanism.GROWTH_INTERVAL,
        start + 2 * mechanism.GROWTH_INTERVAL,
    ]
    assert report["probes"][mechanism.NAME]["summary"]["diagnostics"]["signatures"] == {}
    out = capsys.readouterr().out
    assert f"trainer.max_steps={mechanism.STEPS} ({mechanism.STEPS} steps)" in out
    assert "scaler check: inf injected at step 2: skipped, scale" in out


def test_an_fp32_or_unscaled_config_gets_no_scaler_check(tmp_path):
    from amp_lab.tools.doctor.probes import Doctor

    for precision in ("precision=fp32", "precision=fp16_noscale"):
        doctor = Doctor([*TINY[:-1], precision], 4, tmp_path)
        assert mechanism.NAME not in dict(doctor.plan())
    from amp_lab.tools import probe

    doctor = Doctor([*TINY, "logger.mode=offline"], 4, tmp_path)
    assert mechanism.NAME in dict(doctor.plan())
    # a probe is not the user's run: no W&B, whatever the user's logger
    assert probe.settings(doctor.common).logger.mode == "disabled"


def test_what_the_scaler_did_is_read_from_the_steps():
    rows = [(1, 0, 65536.0), (2, 1, 65536.0), (3, 1, 65536.0), (4, 1, 65536.0)]
    probe = Probe(
        "scaler_check",
        [],
        records=[{"step": s, "amp/skipped_steps": k, "amp/loss_scale": v} for s, k, v in rows],
    )
    seen = mechanism.observed(probe)
    assert seen["skipped"] and seen["scale_after"] == 65536.0 and seen["grew_at"] == []
    assert "skipped, scale 65536 -> 65536, never grew" in mechanism.describe(seen)
    assert not mechanism.observed(Probe("scaler_check", [], records=[]))["ran"]
