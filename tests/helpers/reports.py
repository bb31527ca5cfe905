"""Real runs made for the report tests, and readers of what `amp_lab report` wrote."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from amp_lab.build import build
from amp_lab.tools.report.compare import main
from amp_lab.trainer import Trainer
from helpers.compose import settings

# fp16 activations past 65504 in the first block: every fp16 step is non-finite, fp32's are not
OVERFLOW = ("fault.overflow_module=blocks.0.mlp.fc1", "health.max_bad_steps=3")


def run(root: Path, name: str, *overrides: str, steps: int = 4) -> Path:
    """A real run in root/name, with the .hydra/overrides.yaml a Hydra job would write."""
    run_dir = root / name
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    Trainer(build(settings(*overrides, f"trainer.max_steps={steps}"), run_dir)).fit()
    return run_dir


def report(*args: str) -> dict:
    """Run the report command; its report.json."""
    assert main(list(args)) == 0
    paths = [a for a in args if not a.startswith("--")]
    out = Path(args[args.index("--out") + 1]) if "--out" in args else Path(paths[0]) / "report"
    return json.loads((out / "report.json").read_text())


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def cells(group: dict) -> dict[str, dict]:
    return {cell["value"]: cell for cell in group["cells"]}
