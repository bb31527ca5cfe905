"""The command line as a user types it, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.compose import ROOT


def run_cli(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """`python -m amp_lab ARGS` in a subprocess, as a user types it."""
    # PYTHONPATH: this checkout's package, whichever checkout the venv was installed from
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", "amp_lab", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
