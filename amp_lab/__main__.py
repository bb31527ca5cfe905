"""`python -m amp_lab [overrides]`: one training run (or a sweep with -m) from the Hydra configs.

The installed `amp_lab` command is the same, and runs the lab's tools by name (`TOOLS`):
`amp_lab doctor|report|bench|audit|numerics ARGS`.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from amp_lab.command import error
from amp_lab.compose import validate
from amp_lab.config import CONF_DIR, ConfigError, register
from amp_lab.errors import did_you_mean, null_group, one_line
from amp_lab.sweeps import jobs

log = logging.getLogger("amp_lab")
register()


TOOLS = {
    "doctor": "amp_lab.tools.doctor.cli",
    "report": "amp_lab.tools.report.compare",
    "bench": "amp_lab.tools.bench.cli",
    "audit": "amp_lab.tools.audit",
    "numerics": "amp_lab.tools.numerics.cli",
}


# An absolute path: the installed `amp_lab` script imports this module from anywhere
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Train one run; returns its best val accuracy (for Hydra sweepers)."""
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        jobs.clear_mark(out_dir)
        settings = validate(cfg)  # a bad setting is refused before torch loads (seconds)
        from amp_lab.build import build
        from amp_lab.trainer import Trainer

        return Trainer(build(settings, out_dir)).fit()["best_val_acc"]
    except ConfigError as err:
        # one line, no traceback: a bad setting, or a broken precision promise (the audit's)
        code = error(str(err))
        if hydra_cfg.mode == RunMode.RUN:
            sys.exit(code)
        log.error("job %s skipped: %s", hydra_cfg.job.num, err)  # the sweep goes on
        jobs.mark_refused(out_dir, str(hydra_cfg.job.num), str(err))
        return None


def run_hydra() -> None:
    """main(), with Hydra's own errors and sbatch's refusal of a sweep's jobs as one line and
    exit 2. HYDRA_FULL_ERROR=1 still shows Hydra's full report and traceback."""
    if line := null_group(sys.argv[1:]):
        sys.exit(error(line))
    asked = os.environ.get("HYDRA_FULL_ERROR")
    if asked == "1":
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its report
    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        sys.exit(error(one_line(err)))
    except Exception as err:
        if (line := jobs.slurm_error_line(err)) is None:
            raise
        sys.exit(error(line))
    finally:
        os.environ.pop("HYDRA_FULL_ERROR")
        if asked is not None:
            os.environ["HYDRA_FULL_ERROR"] = asked


def cli() -> None:
    """`amp_lab TOOL ARGS` runs a tool; anything else is a training run's overrides."""
    jobs.skipped.clear()
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:
        sys.exit(importlib.import_module(TOOLS[sys.argv[1]]).main(sys.argv[2:]))
    word = sys.argv[1] if len(sys.argv) > 1 else "="
    if not (word.startswith(("-", "~", "+")) or "=" in word):  # not an override: a tool typo
        sys.exit(
            error(
                f"unknown command {word!r}{did_you_mean(word, TOOLS)} "
                f"(commands: {', '.join(TOOLS)}; anything else is key=value overrides)"
            )
        )
    run_hydra()
    if jobs.skipped:  # the other jobs ran; a script or CI job still learns that some did not
        sys.exit(error(f"{len(jobs.skipped)} sweep job(s) did not run: {'; '.join(jobs.skipped)}"))


if __name__ == "__main__":
    cli()
