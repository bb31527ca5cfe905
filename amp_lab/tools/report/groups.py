"""Comparison groups: runs equal in every setting but the axis (seeds and IGNORED aside), each
against its own reference, so that no run is compared across models or data sets."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from amp_lab.config import AmpLabConfig, flat_settings
from amp_lab.tools.report.runs import SEED_KEY, ReportError, RunData, matches, setting_value

DEFAULT_AXIS = "precision"
REFERENCE_PRECISION = "fp32"
# Settings that change neither what a run learns nor how fast it runs: where the output, the
# logs, the checkpoints and the data files go, progress bars, resuming, the seed (it pairs runs).
IGNORED = (
    "logger",
    "checkpoint",
    "data.root",
    "trainer.progress",
    "trainer.resume",
    "trainer.timing_warmup",
    "trainer.log_every",
    "trainer.eval_every",
    "report",
    SEED_KEY,
)


@dataclass
class Cell:
    """The runs of one group at one axis value (its seeds)."""

    value: str  # its label: `fp16`, or `key=value` for each axis key that varies
    runs: list[RunData]
    first: str  # the value of the label's first key alone (`fp16`, `ddp`): --ref takes it


@dataclass
class Group:
    """Runs equal in every setting but the axis (and seeds), with their reference cell."""

    name: str  # the settings that set this group apart from the others, or "all runs"
    settings: dict[str, str]  # those settings, key -> value
    cells: list[Cell] = field(default_factory=list)
    reference: Cell | None = None  # set by set_references
    reference_note: str = ""  # why there is no reference, when there is none


def is_ignored(key: str) -> bool:
    """Whether a settings key is one of IGNORED or inside one."""
    return any(key == name or key.startswith(name + ".") for name in IGNORED)


def axis_keys(runs: list[RunData], by: str) -> list[str]:
    """The settings keys the axis covers: each comma-separated part of `by` itself, or every
    `part.*` key (`trainer.grad_accum,trainer.batch_size` moves both together)."""
    keys: list[str] = []
    for part in by.split(","):
        found = sorted(
            {k for run in runs for k in run.settings if k == part or k.startswith(part + ".")}
        )
        if not found:
            known = sorted({k.split(".")[0] for run in runs for k in run.settings})
            raise ReportError(
                f"--by {part}: no run has this setting; use a settings key such "
                f"as scaler.init_scale or a group ({', '.join(known) or 'none'})"
            )
        keys += [k for k in found if k not in keys]
    return keys


def _filled(runs: list[RunData]) -> list[dict[str, str]]:
    """Each run's settings, a key it lacks (refused at start-up) filled where all others agree."""
    values: dict[str, set[str]] = {}
    for run in runs:
        for key, value in run.settings.items():
            values.setdefault(key, set()).add(value)
    shared = {key: seen.pop() for key, seen in values.items() if len(seen) == 1}
    return [{**shared, **run.settings} for run in runs]


def _plain(value: str | None) -> str:
    """A JSON setting as a person writes it: `fp16`, not `"fp16"`."""
    if value is None:
        return "—"
    parsed = setting_value(value)
    if isinstance(parsed, float) and parsed.is_integer() and abs(parsed) < 1e15:
        parsed = int(parsed)  # init_scale=65536, not 65536.0
    return parsed if isinstance(parsed, str) else json.dumps(parsed)


def same_value(cell: Cell, wanted: str) -> bool:
    """Whether `wanted` is the cell's label or its first key's value (numbers as numbers)."""
    if wanted in (cell.value, cell.first):
        return True
    try:
        return float(cell.first) == float(wanted)
    except ValueError:
        return False


def _short(key: str) -> str:
    """A key as a label names it: `precision` for precision.name, `master_weights`."""
    group, _, rest = key.partition(".")
    return group if rest == "name" else rest or key


def _axis_label(setting: dict[str, str], keys: list[str], shown: list[str]) -> tuple[str, str]:
    """The cell's label and its first key's value: `fp16`, or where more axis keys vary each as
    `key=value` (`precision=fp16 fp32_modules=["head"]`: a bare `{}` or `true` says nothing)."""
    candidates = [k for k in keys if k in shown] or keys
    first = next((k for k in candidates if k.endswith(".name")), candidates[0])
    value = _plain(setting.get(first))
    if len(shown) < 2:
        return value, value
    ordered = [first, *(k for k in shown if k != first)]
    names = [_short(k) for k in ordered]
    if len(set(names)) < len(names):  # model.kwargs and optim.kwargs: the whole keys
        names = ordered
    return " ".join(f"{n}={_plain(setting.get(k))}" for n, k in zip(names, ordered)), value


def _naming(others: list[str], group_keys: list[tuple[str | None, ...]]) -> list[str]:
    """The keys that tell groups apart, less those a `group.name` key implies (a model's own
    kwargs come with its name): what a person needs to read to know the group."""
    column = {k: [g[i] for g in group_keys] for i, k in enumerate(others)}
    apart = [k for k in others if len(set(column[k])) > 1]

    def implied(key: str) -> bool:
        name = key.split(".")[0] + ".name"
        if key == name or name not in apart:
            return False
        return all(
            len({v for n, v in zip(column[name], column[key]) if n == chosen}) == 1
            for chosen in set(column[name])
        )

    return [k for k in apart if not implied(k)]


def make_groups(runs: list[RunData], by: str) -> list[Group]:
    """The runs in groups and cells, both in first-seen order, with no reference yet."""
    keys = axis_keys(runs, by)
    settings = _filled(runs)
    shown = [k for k in keys if len({s.get(k) for s in settings}) > 1]  # the axis keys that vary
    others = sorted({k for s in settings for k in s if k not in keys and not is_ignored(k)})
    group_keys = [tuple(s.get(k) for k in others) for s in settings]
    apart = _naming(others, group_keys)
    found: dict[tuple[str | None, ...], dict[tuple[str, str], list[RunData]]] = {}
    for run, setting, key in zip(runs, settings, group_keys):
        found.setdefault(key, {}).setdefault(_axis_label(setting, keys, shown), []).append(run)
    groups = []
    for key, cells in found.items():
        own = {k: _plain(v) for k, v in zip(others, key) if k in apart}
        name = ", ".join(f"{k}={v}" for k, v in own.items()) or "all runs"
        members = [Cell(label, runs, first) for (label, first), runs in cells.items()]
        groups.append(Group(name, own, members))
    return groups


def study_axis(runs: list[RunData]) -> tuple[str, str | None]:
    """The runs' `report.by` and `report.ref` (a study's config) where all agree, else precision."""
    named = {(run.settings.get("report.by"), run.settings.get("report.ref")) for run in runs}
    if len(named) != 1:
        return DEFAULT_AXIS, None
    by, ref = (None if v is None else setting_value(v) for v in named.pop())
    return by or DEFAULT_AXIS, ref


def _default_value(by: str) -> str:
    first = by.split(",")[0]
    if first in (DEFAULT_AXIS, "precision.name"):
        return REFERENCE_PRECISION
    return _plain(flat_settings(AmpLabConfig()).get(first))  # the schema's default, as JSON


def set_references(groups: list[Group], by: str, ref: str | None) -> None:
    """Mark each group's reference: the cell holding run `ref`, else of axis value `ref`, else the
    default; it needs a completed run, as figures relative to a crashed run would mislead."""
    cells = [cell for group in groups for cell in group.cells]
    wanted = _default_value(by)
    if ref is not None:
        by_run = next((c for c in cells if any(matches(run, ref) for run in c.runs)), None)
        if by_run is not None:
            wanted = by_run.value
        elif any(same_value(c, ref) for c in cells):
            wanted = ref
        else:
            values = ", ".join(sorted({c.value for c in cells}))
            raise ReportError(
                f"--ref {ref} is neither a run nor a value of {by}; use a run's "
                f"label (e.g. {cells[0].runs[0].label}) or one of: {values}"
            )
    for group in groups:
        candidates = [c for c in group.cells if c.value == wanted] or [
            c for c in group.cells if same_value(c, wanted)
        ]
        group.reference = next((c for c in candidates if any(run.ok for run in c.runs)), None)
        if group.reference is None and candidates:
            group.reference_note = f"no reference: the {candidates[0].value} run did not complete"
        elif group.reference is None:
            group.reference_note = (
                f"no reference: no {by.split(',')[0]}={wanted} run in this group "
                "(pass --ref VALUE or a run's label)"
            )
