"""Finished (or crashed) runs read back from their directories, for reports.

A run directory holds `metrics.jsonl`, `summary.json` and `.hydra/{config,overrides}.yaml`. A run
killed before its summary still loads, from its metrics alone, and is marked incomplete. A file
that cannot be parsed is left out with a warning (and a line of metrics.jsonl that is not a
record is skipped), so one damaged run does not stop a report over a sweep.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from amp_lab.records import HYDRA_DIR, METRICS_FILE, SUMMARY_FILE

log = logging.getLogger(__name__)
RUN_FILES = (METRICS_FILE, SUMMARY_FILE)
SEED_KEY = "trainer.seed"


class ReportError(ValueError):
    """A bad report input, told to the user in one line."""


@dataclass
class RunData:
    """One run's records, summary, overrides and resolved config."""

    path: Path
    overrides: dict[str, str]
    config: dict[str, Any]
    summary: dict[str, Any]
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)

    label: str = ""  # short name, set by load_runs

    def short_name(self) -> str:
        """A sweep job's number (`job 3` for `3_precision=fp16,...`), else the folder's name."""
        match = re.match(r"(\d+)_", self.path.name)
        return f"job {match.group(1)}" if match else self.path.name[:40]

    @property
    def precision(self) -> str:
        name = (self.summary.get("precision") or {}).get("name")
        return name or self.config.get("precision", {}).get("name") or self.overrides.get(
            "precision", "?")

    @property
    def model(self) -> str:
        return self.summary.get("model") or self.config.get("model", {}).get("name", "?")

    @property
    def status(self) -> str:
        if "status" in self.summary:
            return str(self.summary["status"]).strip()
        if not (self.train or self.val):
            return "not started: no records (refused, or never ran)"
        return f"incomplete: no {SUMMARY_FILE}"

    @property
    def ok(self) -> bool:
        return self.status == "completed"

    def group_key(self) -> tuple[tuple[str, str], ...]:
        """Runs that share all overrides except the seed share this key."""
        return tuple(sorted((k, v) for k, v in self.overrides.items() if k != SEED_KEY))


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
        if any((path / name).exists() for name in (*RUN_FILES, HYDRA_DIR)):
            found.add(path)
            continue
        # a sweep job refused at start-up (or not started) has its .hydra/ and nothing else
        runs = {f.parent for name in (*RUN_FILES, HYDRA_DIR) for f in path.rglob(name)
                if "wandb" not in f.relative_to(path).parts}
        if not runs:
            raise ReportError(f"{path} holds no amp_lab runs (no metrics.jsonl or summary.json "
                              "below it); pass a run directory or a multirun directory")
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
    pairs = (item.lstrip("+~").split("=", 1) for item in items if "=" in str(item))
    return {k: v for k, v in pairs if not k.startswith("hydra")}


def load_run(path: Path) -> RunData:
    """One run from its directory; a truncated last line of metrics.jsonl is ignored. Without
    a summary, the figures the metrics hold stand in for it (the run stays incomplete)."""
    run = RunData(path, _overrides(path), _read(path / HYDRA_DIR / "config.yaml",
                                                yaml.safe_load, dict),
                  _read(path / SUMMARY_FILE, json.loads, dict))
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
        run.summary = {"final_val_acc": accs[-1] if accs else None,
                       "best_val_acc": max(accs, default=None),
                       "steps": max((r.get("step", 0) for r in run.train + run.val), default=0),
                       "skipped_steps": last.get("amp/skipped_steps"),
                       "peak_memory_mb": last.get("memory/peak_mb")}
    return run


def load_runs(paths: list[Path]) -> list[RunData]:
    """Every run below the given paths, labelled; `<sweep>/job N` when several sweeps share N."""
    runs = [load_run(path) for path in find_runs(paths)]
    names = [run.short_name() for run in runs]
    for run, name in zip(runs, names):
        run.label = name if names.count(name) == 1 else f"{run.path.parent.name}/{name}"
    return runs


def differing_keys(runs: list[RunData]) -> list[str]:
    """Override keys whose value is not the same in every run."""
    keys = sorted({k for run in runs for k in run.overrides})
    return [k for k in keys if len({run.overrides.get(k) for run in runs}) > 1]


def group_runs(runs: list[RunData]) -> dict[tuple[tuple[str, str], ...], list[RunData]]:
    """Runs grouped by their overrides without the seed, in first-seen order."""
    groups: dict[tuple[tuple[str, str], ...], list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.group_key(), []).append(run)
    return groups


def group_label(runs: list[RunData], keys: list[str]) -> str:
    """A group's name: its differing overrides without the seed, else its precision."""
    first = runs[0]
    parts = [f"{k}={first.overrides[k]}" for k in keys if k != SEED_KEY and k in first.overrides]
    return ",".join(parts) or first.precision


def mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the known values (None when there are none)."""
    known = [v for v in values if v is not None]
    if not known:
        return None, None
    return statistics.fmean(known), statistics.stdev(known) if len(known) > 1 else 0.0
