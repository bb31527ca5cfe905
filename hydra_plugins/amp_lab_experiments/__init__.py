"""Hydra plugin: puts this checkout's experiments/ folder on amp_lab's config search path.

Hydra imports every module under the `hydra_plugins` namespace package at start-up, so
`python -m amp_lab experiment=<study>` finds experiments/experiment/<study>.yaml from any working
directory. Other Hydra apps in the same environment are left alone.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "experiments"


class AmpLabExperimentsSearchPath(SearchPathPlugin):
    """Appends `file://<repo>/experiments` when the app's main config is amp_lab's conf/."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        mains = [p.path for p in search_path.get_path() if p.provider == "main"]
        is_amp_lab = any(not str(path).startswith("pkg://")  # file://DIR or a bare DIR
                         and Path(str(path).removeprefix("file://")).resolve() == REPO / "conf"
                         for path in mains)
        if is_amp_lab and EXPERIMENTS.is_dir():
            search_path.append(provider="amp_lab-experiments", path=f"file://{EXPERIMENTS}")
