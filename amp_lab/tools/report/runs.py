"""Runs read back from their directories for reports: a run killed before its summary from its
metrics alone; an unreadable file left out with a warning, so one damaged run stops no report."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from amp_lab.config import flat_settings
from amp_lab.records import HYDRA_DIR, METRICS_FILE, SETTINGS_FILE, SUMMARY_FILE

log = logging.getLogger(__name__)
RUN_MARKERS = (METRICS_FILE, SUMMARY_FILE, HYDRA_DIR)  # any of them makes a folder a run
SEED_KEY = "trainer.seed"


class ReportError(ValueError):
    """A bad report input, told to the user in one line."""


@dataclass
class RunData:
    """One run's records, summary, resolved config and settings."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, str] = field(default_factory=dict)  # `group.key` -> JSON value

    label: str = ""  # unique short name, set by load_runs

    @property
    def seed(self) -> str | None:
        return self.settings.get(SEED_KEY)

    @property
    def status(self) -> str:
        if "status" in self.summary:
            return str(self.summary["status"]).strip()
        if not (self.train or self.val):
            return "not started: no records (refused, or never ran)"
        return "incomplete: no summary.json"

    @property
    def ok(self) -> bool:
        return self.status == "completed"


def setting_value(text: str | None) -> Any:
    """A recorded setting (JSON) as its value; text that is not JSON stays itself."""
    try:
        return None if text is None else json.loads(text)
    except json.JSONDecodeError:
        return text


def _natural(path: Path) -> tuple[Any, ...]:
    """Sort key: sweep job 2 before job 10."""
    match = re.match(r"(\d+)_", path.name)
    return (str(path.parent), int(match.group(1)) if match else -1, path.name)


def find_runs(paths: list[Path]) -> list[Path]:
    """The run directories in the given paths (multirun directories or run directories)."""
    found: set[Path] = set()
    for path in paths:
        if not path.is_dir():
            raise ReportError(f"{path} is not a directory; pass run or multirun directories")
        if any((path / name).exists() for name in RUN_MARKERS):
            found.add(path)
            continue
        # a sweep job refused at start-up (or not started) has its .hydra/ and nothing else
        runs = {
            f.parent
            for name in RUN_MARKERS
            for f in path.rglob(name)
            if "wandb" not in f.relative_to(path).parts
        }
        if not runs:
            raise ReportError(
                f"{path} holds no amp_lab runs (no metrics.jsonl or summary.json "
                "below it); pass a run directory or a multirun directory"
            )
        found |= runs
    return sorted(found, key=_natural)


def _read(file: Path, parse: Any, kind: type) -> Any:
    """The parsed file if it exists and holds a `kind`, else an empty one (with a warning)."""
    if not file.exists():
        return kind()
    try:
        value = parse(file.read_text())
        if value is None or isinstance(value, kind):
            return value or kind()
        raise ValueError(f"holds a {type(value).__name__}, not a {kind.__name__}")
    except (OSError, ValueError, yaml.YAMLError) as err:  # JSONDecodeError is a ValueError
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        log.warning("%s is unreadable (%s); the run is read without it", file, reason)
        return kind()


def _overrides(path: Path) -> dict[str, str]:
    items = _read(path / HYDRA_DIR / "overrides.yaml", yaml.safe_load, list)
    pairs = (str(item).lstrip("+~").split("=", 1) for item in items if "=" in str(item))
    return {k: v for k, v in pairs if not k.startswith("hydra")}


def _settings(path: Path, config: dict[str, Any], overrides: dict[str, str]) -> dict[str, str]:
    """The run's flat settings: settings.json, else the resolved config, else its overrides
    (a run refused at start-up has only those; `precision=fp16` stands for `precision.name`)."""
    flat = _read(path / SETTINGS_FILE, json.loads, dict) or flat_settings(config)
    if not flat:
        for key, value in overrides.items():
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                parsed = value
            flat[key if "." in key else f"{key}.name"] = json.dumps(parsed, sort_keys=True)
    return {k: str(v) for k, v in flat.items()}


def load_run(path: Path) -> RunData:
    """One run from its directory; without a summary, its metrics' figures stand in for it."""
    overrides = _overrides(path)
    config = _read(path / HYDRA_DIR / "config.yaml", yaml.safe_load, dict)
    summary = _read(path / SUMMARY_FILE, json.loads, dict)
    run = RunData(path, config, summary, settings=_settings(path, config, overrides))
    metrics = path / METRICS_FILE
    for line in metrics.read_text(errors="replace").splitlines() if metrics.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a run killed mid-write
            continue
        if isinstance(record, dict):
            (run.train if record.get("kind") == "train" else run.val).append(record)
    if not run.summary and (run.train or run.val):
        accs = [r["val/acc"] for r in run.val if r.get("val/acc") is not None]
        last = run.train[-1] if run.train else {}
        losses = [r["val/loss"] for r in run.val if r.get("val/loss") is not None]
        run.summary = {
            "final_val_acc": accs[-1] if accs else None,
            "best_val_acc": max(accs, default=None),
            "final_val_loss": losses[-1] if losses else None,
            "final_loss_scale": last.get("amp/loss_scale"),
            "steps": max((r.get("step", 0) for r in run.train + run.val), default=0),
            "skipped_steps": last.get("amp/skipped_steps"),
            "peak_memory_mb": last.get("memory/peak_mb"),
        }
    return run


def _short(names: list[str]) -> list[str]:
    """Job directory names without the `key=value` items every one of them shares
    (`3_data.img_size=16,precision=fp16` and `4_data.img_size=16,precision=bf16` give
    `3_precision=fp16`, `4_precision=bf16`); a name left empty keeps its whole form."""

    def items(name: str) -> list[str]:
        return re.sub(r"^\d+_", "", name).split(",")

    common = set.intersection(*(set(items(n)) for n in names)) if len(names) > 1 else set()
    shorts = []
    for name in names:
        kept = [item for item in items(name) if item not in common]
        num = re.match(r"(\d+)_", name)
        shorts.append((num.group(0) if num else "") + ",".join(kept) if kept else name)
    return shorts


def load_runs(paths: list[Path]) -> list[RunData]:
    """Every run below the given paths, each with a unique label: its job directory's name
    (shared items left out), prefixed by its parent folders where names repeat."""
    runs = [load_run(path) for path in find_runs(paths)]
    labels = _short([run.path.name for run in runs])
    for depth in range(1, 64):
        if len(set(labels)) == len(labels):
            break
        labels = [
            label
            if labels.count(label) == 1
            else "/".join([*run.path.parent.parts[-depth:], label.split("/")[-1]])
            for run, label in zip(runs, labels)
        ]
    for run, label in zip(runs, labels):
        run.label = label
    return runs


def matches(run: RunData, name: str) -> bool:
    """Whether `name` (a label, a job directory's name or a path) names this run."""
    if name in (run.label, run.path.name):
        return True
    try:
        return Path(name).resolve() == run.path.resolve()
    except OSError:
        return False
