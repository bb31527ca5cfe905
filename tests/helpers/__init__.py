"""What the tests share: composing the real configs shrunk for CPU, the CLI as a user runs it, and
readers of what a run wrote. conftest.py keeps only fixtures and hooks.

`from helpers import settings, run_cli` covers most tests; the modules hold the rest
(resume: interrupt and compare runs; sinks: failing sinks; slurm: the test cluster's job
settings; wandb_records: W&B's offline file reader).
"""

from helpers.cli import run_cli
from helpers.compose import CONF_DIR, DOCTOR_TINY, FAST, ROOT, compose_cfg, leaves, settings

__all__ = [
    "CONF_DIR",
    "DOCTOR_TINY",
    "FAST",
    "ROOT",
    "compose_cfg",
    "leaves",
    "run_cli",
    "settings",
]
