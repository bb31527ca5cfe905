"""Compose the real Hydra configs, shrunk for CPU: few steps, tiny models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from amp_lab.compose import compose_settings
from amp_lab.config import AmpLabConfig, register

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT / "amp_lab" / "conf"

# Small and fast on 2 CPU cores: a tiny ViT on 16x16 digits (fp16 on CPU is slow), few steps.
FAST = [
    "model=test_vit",
    "data.img_size=16",
    "trainer.batch_size=16",
    "trainer.max_steps=6",
    "trainer.log_every=2",
    "trainer.timing_warmup=1",
    "trainer.progress=false",
    "trainer.device=cpu",
    "logger.mode=disabled",
]  # W&B offline costs ~1-2 s a run

# The doctor's smallest run (a one-block ViT on 8 px digits): its probes take seconds
DOCTOR_TINY = [
    "model=test_vit",
    "data.img_size=8",
    "trainer.batch_size=8",
    "data.val_fraction=0.05",
    "+model.kwargs.depth=1",
    "trainer.device=cpu",
]

register()  # the schema in Hydra's ConfigStore: conf/config.yaml's defaults start with it


def compose_cfg(*overrides: str, fast: bool = True) -> DictConfig:
    """The composed config, exactly as `python -m amp_lab <overrides>` would see it."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=[*(FAST if fast else []), *overrides])


def settings(*overrides: str, fast: bool = True) -> AmpLabConfig:
    """The validated settings of `python -m amp_lab <overrides>` (FAST first unless fast=False),
    composed as the lab's tools compose them (ConfigError when bad)."""
    return compose_settings([*(FAST if fast else []), *overrides])


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """`a.b.c` -> value for every leaf of a nested dict, as a YAML file sets them (a list is a
    leaf)."""
    if not isinstance(node, dict):
        return {prefix: node}
    return {
        k: v
        for key, value in node.items()
        for k, v in leaves(value, f"{prefix}.{key}" if prefix else str(key)).items()
    }
