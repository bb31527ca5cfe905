"""`amp_lab numerics --steps N`: fp32 and the mode train N steps from the same weights and data
order; their weights part ways as rounding explains on a healthy run, faster where the dynamics
amplify the difference (a learning rate 100x too high)."""

from __future__ import annotations

import json

from helpers import FAST

from amp_lab.tools.numerics.cli import NUMERICS_FILE, main
from amp_lab.tools.numerics.find import find
from amp_lab.tools.numerics.weight_drift import drift_lines

STEPS = 6


def test_a_healthy_bf16_run_drifts_from_fp32_as_rounding_explains():
    found = find([*FAST, "precision=bf16"], "fp32", [], steps=STEPS)["modes"]["bf16"]["drift"]
    rows = found["steps"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert 0 < rows[0]["diff"] <= rows[-1]["diff"]  # apart from step 1, and not converging
    assert all(r["diff"] < 2 * r["envelope"] for r in rows)
    assert found["first_faster_step"] is None
    assert drift_lines(found)[-1] == "  weights stay within what rounding explains"


def test_weights_parting_faster_than_rounding_are_named_with_their_step(tmp_path, capsys):
    code = main(
        [*FAST, "precision=bf16", "lr.scale=100", "--steps", str(STEPS), "--out", str(tmp_path)]
    )
    assert code in (0, 1)  # the one-batch comparison decides the exit code
    found = json.loads((tmp_path / NUMERICS_FILE).read_text())["modes"]["bf16"]["drift"]
    step = found["first_faster_step"]
    assert step is not None and 2 <= step <= STEPS
    row = found["steps"][step - 1]
    assert row["diff"] > 2 * row["envelope"]
    assert all(r["diff"] <= 2 * r["envelope"] for r in found["steps"][: step - 1])
    assert found["first_layers"]
    assert f"weights part ways faster than rounding from step {step}, first in: " in (
        capsys.readouterr().out
    )
