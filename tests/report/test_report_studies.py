"""Each study's README carries its CPU variant's findings exactly as `make studies` wrote them:
the block between the markers is what the committed report.json renders to, overview included."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from amp_lab.report.readme import END, START, findings

ROOT = Path(__file__).resolve().parents[2]
STUDIES = sorted(p.name for p in (ROOT / "experiments").iterdir() if p.is_dir())
MAKEFILE = (ROOT / "Makefile").read_text()


@pytest.mark.parametrize("study", STUDIES)
def test_study_readme_holds_its_report(study: str) -> None:
    folder = ROOT / "experiments" / study
    data = json.loads((folder / "report" / "report.json").read_text())
    readme = (folder / "README.md").read_text()
    block = readme.split(START, 1)[1].split(END, 1)[0]
    assert block.strip("\n") == findings(data, "report/overview.png")
    assert (folder / "report" / "overview.png").stat().st_size > 20_000
    assert data["context"]["report_command"].startswith(
        f"python -m amp_lab.report multirun/studies/{study}"
    )  # as `make study-{study}` runs it
    ranks = re.search(rf"^LAUNCH_{study} := .*--nproc_per_node=(\d+)", MAKEFILE, flags=re.M)
    launch = f"torchrun --nproc_per_node={ranks.group(1)}" if ranks else "python"  # as make runs it
    assert data["context"]["commands"] == [
        f"{launch} -m amp_lab -m +experiment/cpu={study} logger=disabled"
    ]
    for group in data["groups"]:
        assert f"**Verdict:** {group['verdict']}" in block
