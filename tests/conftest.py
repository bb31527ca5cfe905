"""Compose the real Hydra configs, shrunk for CPU: few steps, tiny models, output in tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from amp_lab.config import AmpLabConfig, compose_settings, register

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "amp_lab" / "conf"

# Small and fast on 2 CPU cores: a tiny ViT on 16x16 digits (fp16 on CPU is slow), few steps.
FAST = ["model=test_vit", "data.img_size=16", "trainer.batch_size=16", "trainer.max_steps=6",
        "trainer.log_every=2", "trainer.timing_warmup=1", "trainer.progress=false",
        "trainer.device=cpu", "logger.mode=disabled"]  # W&B offline costs ~1-2 s a run

register()
# One torch thread per process: on 2 shared cores a tiny model runs several times faster than
# with threads fighting over them; subprocesses (CLI runs, SLURM jobs) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def compose_cfg(*overrides: str, fast: bool = True) -> DictConfig:
    """The composed config, exactly as `python -m amp_lab <overrides>` would see it."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=[*(FAST if fast else []), *overrides])


def settings(*overrides: str, fast: bool = True) -> AmpLabConfig:
    """The validated settings, as the lab's tools compose them (ConfigError when bad)."""
    return compose_settings([*(FAST if fast else []), *overrides])


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """`a.b.c` -> value for every leaf of a nested dict, as a YAML file sets them (a list is a
    leaf)."""
    if not isinstance(node, dict):
        return {prefix: node}
    return {k: v for key, value in node.items()
            for k, v in leaves(value, f"{prefix}.{key}" if prefix else str(key)).items()}


def run_cli(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m amp_lab ARGS` in a subprocess, as a user types it."""
    # PYTHONPATH: this checkout's package, whichever checkout the venv was installed from
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "amp_lab", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fast_overrides() -> list[str]:
    return list(FAST)
