"""The compile_cache part of `python -m benchmarks.bench`: a configuration that fails to compile
is recorded, and the other parts go on."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench

# as tests/tools/bench's: a tiny ViT, few steps, the precisions given per test
TINY = ["--models", "test_vit", "--img-size", "16", "--batch-size", "8", "--steps", "2"]
TINY += ["--rounds", "1", "--warmup", "1", "--device", "cpu"]


@pytest.mark.slow
def test_a_configuration_that_fails_to_compile_is_recorded_and_the_rest_go_on(tmp_path):
    # The config composes, but this machine has no CUDA device: the process fails at start-up.
    code = bench.main(
        [
            *TINY,
            "--parts",
            "compile_cache",
            "--override",
            "trainer.device=cuda",
            "--precisions",
            "fp32",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    (record,) = json.loads((tmp_path / "bench.json").read_text())["compile_cache"]
    assert (
        record["first_step_s"] is None
        and "exit 1: benchmarks.compile_cache: error:" in record["error"]
        and "cuda" in record["error"].lower()
    )
    assert "| test_vit | fp32 | failed: exit 1" in (tmp_path / "bench.md").read_text()
