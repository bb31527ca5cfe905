"""`--suite --draw N --seed S`: cases drawn anew from every failure class, reproducible by seed,
and the figures per class."""

from __future__ import annotations

import pytest

from amp_lab.compose import compose_settings
from benchmarks.doctor_draw import CLASSES, MODELS, draw
from benchmarks.doctor_suite import figures, main


def test_a_seed_draws_the_same_cases_and_every_class_once_per_round():
    cases = draw(2 * len(CLASSES), seed=5)
    assert cases == draw(2 * len(CLASSES), seed=5)
    assert cases != draw(2 * len(CLASSES), seed=6)
    for round_ in (cases[: len(CLASSES)], cases[len(CLASSES) :]):
        assert sorted(c.kind for c in round_) == sorted(CLASSES)
    assert {c.overrides[0] for c in draw(60, seed=5)} == {f"model={m}" for m in MODELS}


def test_every_drawn_case_is_a_valid_config_of_its_class():
    for case in draw(len(CLASSES), seed=3, models=["test_vit"]):
        settings = compose_settings(list(case.overrides))  # a bad draw fails here
        assert settings.model.name == "test_vit" and case.base == ()
        if case.kind == "update_every_microbatch":  # the mistake needs accumulation
            assert settings.trainer.grad_accum >= 2
        if case.kind == "clip_before_unscale":
            assert settings.trainer.clip_grad > 0
        if case.kind == "forward_overflow":
            assert settings.fault.overflow_module.startswith("blocks.")


def test_the_figures_are_given_per_class():
    row = {"right_first": True, "alarm": False, "fix": "a", "verified": True, "seconds": 10.0}
    rows = [
        {**row, "class": "healthy", "expected": "none", "fix": None, "verified": None},
        {**row, "class": "no_scaler_update", "expected": "no_scaler_update", "fix_verified": True},
        {**row, "class": "no_scaler_update", "expected": "no_scaler_update", "right_first": False,
         "next": "next: ...", "seconds": 30.0},
    ]  # fmt: skip
    result = figures(rows)
    assert result["per_class"]["no_scaler_update"] == {
        "cases": 2,
        "right_first": 1,
        "alarms": 0,
        "fix_verified": 1,
        "next_line": 1,
    }
    assert (result["failure_cases"], result["ended_verified"], result["ended_with_next"]) == (
        2,
        1,
        1,
    )
    assert (result["median_s"], result["max_s"]) == (10.0, 30.0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--models", "vgg"], "amp_lab: error: unknown --models vgg"),
        (["--cases", "healthy"], "amp_lab: error: --cases picks fixed cases"),
    ],
)
def test_bad_draw_input_is_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert main(["--draw", "2", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)
    assert not out.exists()


def test_the_documented_draw_on_main_is_its_committed_suite_files():
    """benchmarks/results/doctor_suite.md's re-measured table of the drawn cases reads
    benchmarks/results/doctor_draw/seed_<S>.json row by row."""
    import json
    import re

    from helpers import ROOT

    text = (ROOT / "benchmarks/results/doctor_suite.md").read_text()
    section = text[text.index("### Re-measured on main") :]
    rows = re.findall(
        r"^\| (\d+) \| (\d+/\d+) \| (\d+/\d+) \| (\d+/\d+) \| (\d+) \| (\d+) / (\d+) \|",
        section,
        flags=re.M,
    )
    assert len(rows) == 3
    for seed, right, alarms, ended, nexts, median, worst in rows:
        saved = json.loads((ROOT / f"benchmarks/results/doctor_draw/seed_{seed}.json").read_text())
        f = saved["figures"]
        assert (saved["seed"], saved["draw"]) == (int(seed), 30)
        healthy = sum(r["class"] in ("healthy", "one_transient_inf_step") for r in saved["cases"])
        assert right == f"{f['right_first']}/{f['cases']}"
        assert alarms == f"{f['alarms_on_healthy']}/{healthy}"
        assert ended == f"{f['ended_verified']}/{f['failure_cases']}"
        assert int(nexts) == f["ended_with_next"]
        assert (int(median), int(worst)) == (round(f["median_s"]), round(f["max_s"]))
