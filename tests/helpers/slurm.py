"""The test SLURM cluster (scripts/slurm_cluster.sh): its script and the job settings it fits."""

from __future__ import annotations

from helpers.compose import ROOT

SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
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
