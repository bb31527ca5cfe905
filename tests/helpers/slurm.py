"""The test SLURM cluster (scripts/slurm_cluster.sh): which one the suite may use, whether it is
up, and the job settings it fits."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from helpers.compose import ROOT

SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
# the script's state folder: its default, or the one SLURM_CLUSTER_DIR names, as the script reads it
CLUSTER_DIR = Path(os.environ.get("SLURM_CLUSTER_DIR", "/tmp/amp_lab_slurm"))
MARKER = "# written by amp_lab scripts/slurm_cluster.sh"  # the first line of its slurm.conf
START = "scripts/slurm_cluster.sh start"


def cluster_conf(cluster_dir: Path = CLUSTER_DIR) -> Path | None:
    """The slurm.conf the script wrote in cluster_dir; None where it wrote none."""
    conf = cluster_dir / "slurm.conf"
    try:
        return conf if conf.read_text().startswith(MARKER) else None
    except OSError:
        return None


def why_not_up(cluster_dir: Path = CLUSTER_DIR) -> str | None:
    """None while the script's cluster in cluster_dir is up, else why a SLURM test skips."""
    if cluster_conf(cluster_dir) is None:
        return f"no test SLURM cluster in {cluster_dir}: {START} (as root) makes one"
    env = {**os.environ, "SLURM_CLUSTER_DIR": str(cluster_dir)}
    if subprocess.run([SCRIPT, "status"], env=env, capture_output=True, timeout=60).returncode:
        return f"the test SLURM cluster in {cluster_dir} is stopped: {START} (as root) starts it"
    return None


# tiny jobs for a 2-core machine
JOB = [
    "model=test_vit",
    "data.img_size=16",
    "trainer.batch_size=16",
    "trainer.device=cpu",
    "trainer.progress=false",
    "data.val_fraction=0.05",
    "logger.mode=disabled",  # no assertion reads W&B here; its offline run costs a job ~1-2 s
]
# the slurm preset asks for a GPU node; this test cluster has 1-CPU slots and no GPUs
ON_TEST_CLUSTER = [
    "hydra.launcher.gpus_per_node=null",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=null",
]
