"""Each study's README carries its CPU variant's findings exactly as `make studies` wrote them:
the block between the markers is what the committed report.json renders to, overview included."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from amp_lab.tools.report.search import markdown as search_markdown
from amp_lab.tools.report.tables import END, START, findings

ROOT = Path(__file__).resolve().parents[3]
STUDIES = sorted(p.name for p in (ROOT / "experiments").iterdir() if p.is_dir())
MAKEFILE = (ROOT / "Makefile").read_text()


@pytest.mark.parametrize("study", STUDIES)
def test_study_readme_holds_its_report(study: str) -> None:
    folder = ROOT / "experiments" / study
    data = json.loads((folder / "report" / "report.json").read_text())
    readme = (folder / "README.md").read_text()
    block = readme.split(START, 1)[1].split(END, 1)[0]
    # a search (lr_per_precision) is reported as one: its studies and search.png
    search = data.get("kind") == "search"
    picture = "report/search.png" if search else "report/overview.png"
    expected = search_markdown(data, picture) if search else findings(data, picture)
    assert block.strip("\n") == expected
    assert (folder / picture).stat().st_size > 20_000
    assert data["context"]["report_command"].startswith(
        f"python -m amp_lab report multirun/studies/{study}"
    )  # as `make study-{study}` runs it
    ranks = re.search(rf"^LAUNCH_{study} := .*--nproc_per_node=(\d+)", MAKEFILE, flags=re.M)
    launch = f"torchrun --nproc_per_node={ranks.group(1)}" if ranks else "python"  # as make runs it
    assert data["context"]["commands"] == [
        f"{launch} -m amp_lab -m +experiment/cpu={study} logger=disabled"
    ]
    for group in data.get("groups", []):
        assert f"**Verdict:** {group['verdict']}" in block
    for study_ in data.get("studies", []):
        assert f"- {study_['verdict']}" in block


def test_per_rank_memory_columns_show_when_the_runs_report_them() -> None:
    """fsdp_precision's runs record per-rank parameter and gradient bytes: FSDP's halves show
    beside DDP's; runs of a study made before amp_lab recorded them show no empty column."""
    fsdp = json.loads((ROOT / "experiments/fsdp_precision/report/report.json").read_text())
    table = findings(fsdp, "overview.png").splitlines()
    header = next(line for line in table if line.startswith("| trainer.strategy"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[columns.index("peak MB") + 1 : columns.index("skipped")] == [
        "params MB",
        "grads MB",
        "state MB",
    ]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table}
    at = columns.index("params MB")
    assert rows["ddp param_dtype=auto reduce_dtype=auto (ref)"][at : at + 3] == [
        "1.02 ± 0.00",
        "1.02 ± 0.00",
        "2.05 ± 0.00",
    ]
    assert rows["fsdp param_dtype=auto reduce_dtype=auto"][at : at + 3] == [
        "0.51 ± 0.00",
        "0.51 ± 0.00",
        "1.02 ± 0.00",
    ]
    older = json.loads((ROOT / "experiments/scaler_grid/report/report.json").read_text())
    for group in older["groups"]:  # as runs made before amp_lab recorded the two
        for cell in group["cells"]:
            del cell["figures"]["param_bytes"], cell["figures"]["grad_bytes"]
    text = findings(older, "overview.png")
    assert "state MB" in text and "params MB" not in text and "grads MB" not in text
