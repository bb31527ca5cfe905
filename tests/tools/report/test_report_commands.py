"""The report's "Made with" command: the one a user types to make the runs again."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from amp_lab.tools.report.context import commands
from amp_lab.tools.report.runs import RunData

BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


def _sweep_run(tmp_path: Path, launcher: str, world_size: int) -> RunData:
    sweep = tmp_path / launcher.rsplit(".", 1)[1]
    (sweep / "0_precision=fp32").mkdir(parents=True)
    hydra = {"launcher": {"_target_": launcher}, "overrides": {"task": ["precision=fp32,bf16"]}}
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": hydra}))
    return RunData(sweep / "0_precision=fp32", {}, {"world_size": world_size})


@pytest.mark.parametrize(
    ("launcher", "world_size", "launch"),
    [
        (BASIC, 1, "python"),
        (BASIC, 2, "torchrun --nproc_per_node=2"),  # the ranks of a local sweep: torchrun's
        (SLURM, 2, "python"),  # submitit starts the SLURM tasks itself
    ],
)
def test_a_sweeps_command_names_how_its_ranks_were_started(tmp_path, launcher, world_size, launch):
    run = _sweep_run(tmp_path, launcher, world_size)
    assert commands([run]) == [f"{launch} -m amp_lab -m precision=fp32,bf16"]
