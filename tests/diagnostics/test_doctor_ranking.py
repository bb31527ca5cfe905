"""The doctor's fp32_modules advice comes from the divergence finder's ranking, and is still
verified by a run with it (docs/diagnostics.md)."""

from __future__ import annotations

import json

import pytest
from helpers import DOCTOR_TINY

from amp_lab.tools.doctor.cli import main

TINY = DOCTOR_TINY


@pytest.mark.slow
def test_the_doctors_fp32_modules_advice_is_the_finders_first_candidate(tmp_path, capsys):
    culprit = "blocks.0.mlp.fc2"
    args = [*TINY, "precision=fp16", f"fault.overflow_module={culprit}", "--steps", "4"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert report["numerics"]["fp32_candidates"][0] == culprit
    assert report["numerics"]["first_out_of_band"]["forward"]["module"] == culprit
    rec = report["recommendations"][0]
    assert rec["override"] == f"precision.fp32_modules=[{culprit}]"
    assert f"amp_lab numerics ranks {culprit} first" in rec["evidence"]
    assert rec["verified"] is True  # the finder ranks; a run with the fix still decides
    assert f"fp32_modules candidates, best first: {culprit}" in capsys.readouterr().out
