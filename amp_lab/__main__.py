"""`python -m amp_lab [overrides]`: one training run (or a sweep with -m) from the Hydra configs."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from amp_lab.config import ConfigError, register, validate

log = logging.getLogger("amp_lab")
register()
# conf/hydra/launcher/submitit_slurm.yaml shadows the plugin's config of that name on purpose,
# so `hydra/launcher=submitit_slurm` brings amp_lab's requeue-safe cluster defaults.
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_slurm' is validated")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Train one run; returns its best val accuracy (for Hydra sweepers)."""
    from amp_lab.train import Trainer  # after Hydra parsed the command line: --help stays fast

    hydra_cfg = HydraConfig.get()
    try:
        trainer = Trainer(validate(cfg), Path(hydra_cfg.runtime.output_dir))
    except ConfigError as err:
        # One line, no traceback; nothing was written but Hydra's own .hydra/ folder.
        print(f"amp_lab: error: {err}", file=sys.stderr)
        if hydra_cfg.mode == RunMode.RUN:
            sys.exit(2)
        log.error("job %s skipped: %s", hydra_cfg.job.num, err)  # the sweep goes on
        return None
    return trainer.fit()["best_val_acc"]


if __name__ == "__main__":
    main()
