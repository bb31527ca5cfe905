"""The beyond_autocast study composes with the main config, and each CPU sweep point starts."""

from __future__ import annotations

import pytest
from conftest import CONF_DIR, ROOT
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from amp_lab.config import AmpLabConfig, validate
from amp_lab.train import Trainer

EXPERIMENTS = ROOT / "experiments"


def _compose(*overrides: str) -> DictConfig:
    # experiments/ passed explicitly: the same search path the CLI gets from --config-dir
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", return_hydra_config=True, overrides=[
            f"hydra.searchpath=[file://{EXPERIMENTS}]", *overrides])


def _sweep(cfg: DictConfig) -> list[str]:
    return cfg.hydra.sweeper.params.precision.split(",")


def _settings(cfg: DictConfig) -> AmpLabConfig:
    with open_dict(cfg):
        del cfg["hydra"]  # what the job sees: the hydra node is not part of the schema
    return validate(cfg)


def test_gpu_study_sweeps_the_four_modes_on_a_fp8_friendly_vit():
    cfg = _compose("+experiment=beyond_autocast")
    assert _sweep(cfg) == ["bf16", "bf16_pure", "fp16", "fp8"]
    settings = _settings(cfg)
    assert settings.model.name == "vit_small_patch16_224" and settings.data.name == "cifar10"
    assert settings.precision.fp8_emulate is False  # real float8 kernels on the GPU
    assert (EXPERIMENTS / "beyond_autocast" / "README.md").is_file()


@pytest.mark.parametrize("precision", ["bf16", "bf16_pure", "fp16", "fp8"])
def test_cpu_study_points_start_on_cpu(tmp_path, precision):
    cfg = _compose("+experiment/cpu=beyond_autocast", f"precision={precision}")
    assert precision in _sweep(cfg)
    trainer = Trainer(_settings(cfg), tmp_path)  # every check of the mode passes on CPU
    assert trainer.device.type == "cpu" and trainer.policy.mode.name == precision
    assert trainer.settings.precision.fp8_emulate is True
    assert trainer.settings.model.name == "test_vit" and trainer.total_steps == 60
