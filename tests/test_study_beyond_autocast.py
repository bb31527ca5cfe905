"""The beyond_autocast study composes with the main config, and each CPU sweep point starts."""

from __future__ import annotations

import pytest
from helpers import CONF_DIR, ROOT, compose_cfg
from hydra import compose, initialize_config_dir

from amp_lab.build import build
from amp_lab.compose import validate
from amp_lab.trainer import Trainer


def _sweep(experiment: str) -> list[str]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", [experiment], return_hydra_config=True)
    return cfg.hydra.sweeper.params.precision.split(",")


def test_gpu_study_sweeps_the_four_modes_on_a_fp8_friendly_vit():
    assert _sweep("experiment=beyond_autocast") == ["bf16", "bf16_pure", "fp16", "fp8"]
    settings = validate(compose_cfg("experiment=beyond_autocast", fast=False))
    assert settings.model.name == "vit_small_patch16_224" and settings.data.name == "cifar10"
    assert settings.model.kwargs["patch_size"] == 4  # Linear dims 384/1152/1536: fp8 applies
    assert settings.precision.fp8_emulate is False  # real float8 kernels on the GPU
    assert (ROOT / "experiments" / "beyond_autocast" / "README.md").is_file()


@pytest.mark.parametrize("precision", ["bf16", "bf16_pure", "fp16", "fp8"])
def test_cpu_study_points_start_on_cpu(tmp_path, precision):
    assert precision in _sweep("+experiment/cpu=beyond_autocast")
    settings = validate(
        compose_cfg("+experiment/cpu=beyond_autocast", f"precision={precision}", fast=False)
    )
    trainer = Trainer(build(settings, tmp_path))  # every check of the mode passes on CPU
    assert trainer.run.device.type == "cpu" and trainer.run.policy.mode.name == precision
    assert settings.precision.fp8_emulate is True
    assert settings.model.name == "test_vit" and trainer.run.total_steps == 60
