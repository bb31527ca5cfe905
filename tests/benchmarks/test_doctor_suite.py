"""The doctor benchmark: every failure case names its cause first and its top fix verifies.

The cheap cases run in the fast tier; every case runs in the slow tier (`make doctor-bench`
runs them all in one command and prints the figures of benchmarks/results/doctor_suite.md).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.doctor_suite import CASES, HEALTHY, figures, main, run_case

FAST = {"healthy"}  # the no-alarm case; the failure classes run in the slow tier


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name, marks=() if c.name in FAST else pytest.mark.slow) for c in CASES],
)
def test_each_case_names_its_cause_first_and_verifies_its_fix(tmp_path, case):
    row = run_case(case, tmp_path)
    assert row["top_cause"] == case.cause, row
    if case.cause in HEALTHY:
        assert not row["alarm"] and row["fix"] is None
        text = (tmp_path / f"{case.name}.txt").read_text()
        assert "no precision problem found" in text
        if case.name == "one_transient_inf_step":
            assert "the scaler handled 1 transient overflow (skipped step 3" in text
    else:
        assert row["verified"] is True, row["verification"]


def test_the_figures_count_what_the_targets_need():
    rows = [{"right_first": True, "alarm": False, "fix": "a", "verified": True}] * 9 + [
        {"right_first": False, "alarm": False, "fix": None, "verified": None}
    ]
    result = figures(rows)
    assert result["right_first_share"] == 0.9 and result["targets_met"] is True
    alarm = figures([*rows[:9], {**rows[9], "alarm": True}])
    assert alarm["alarms_on_healthy"] == 1 and alarm["targets_met"] is False
    unverified = figures([{**rows[0], "verified": False}, *rows[1:]])
    assert unverified["top_fixes_verified"] == 8 and unverified["targets_met"] is False


@pytest.mark.slow
def test_the_suite_command_writes_its_figures(tmp_path, capsys):
    assert main(["--cases", "healthy", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "right cause first: 1/1 (100%, target >= 90%); alarms on healthy cases: 0" in out
    saved = json.loads((tmp_path / "suite.json").read_text())
    assert saved["figures"]["targets_met"] is True and saved["cases"][0]["case"] == "healthy"


def test_an_unknown_case_is_one_line(tmp_path, capsys):
    assert main(["--cases", "nope", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("amp_lab: error: unknown suite case nope")
    assert not (tmp_path / "out").exists()
