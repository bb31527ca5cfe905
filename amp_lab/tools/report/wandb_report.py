"""The comparison as a W&B Report (wandb-workspaces): saved online, or its spec as JSON offline.

Per comparison group: a heading, its verdict and a panel grid over the sweep's W&B group narrowed
to the group's settings (loss, accuracy, loss scale, throughput, memory); then parallel
coordinates over the settings that vary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.console import Console

from amp_lab.records import WANDB_ID_FILE
from amp_lab.tools.report.groups import is_ignored
from amp_lab.tools.report.runs import RunData, setting_value
from amp_lab.tracking.wandb_sink import redact, sweep_group

SPEC_FILE = "wandb_report.json"


def run_groups(runs: list[RunData]) -> tuple[list[str], list[str]]:
    """(W&B groups, ids of runs in no group), as tracking set them: logger.group, else the sweep
    directory for multirun jobs (Hydra writes multirun.yaml there); a single run has no group."""
    groups, loose = [], []
    for run in runs:
        group = run.config.get("logger", {}).get("group")
        if group is None and (run.path.parent / "multirun.yaml").exists():
            group = sweep_group(run.path.parent)
        if group is not None:
            groups.append(group)
        elif (run.path / WANDB_ID_FILE).exists():
            loose.append((run.path / WANDB_ID_FILE).read_text().strip())
    return list(dict.fromkeys(groups)), loose


def _literal(value: str) -> str:
    """A config value in a W&B filter expression: numbers bare, everything else quoted."""
    try:
        float(value)
        return value
    except ValueError:
        return repr(value)


def varying_leaves(runs: list[RunData]) -> list[str]:
    """Settings keys with one number or string each (W&B config leaf keys) that differ between
    runs; a dict such as `model.kwargs` is not a leaf."""
    keys = sorted({k for run in runs for k in run.settings})
    return [
        k
        for k in keys
        if len({run.settings.get(k) for run in runs}) > 1
        and not any(isinstance(setting_value(run.settings.get(k)), (dict, list)) for run in runs)
        and not is_ignored(k)
    ]


# report.md's curves and its summary figures, as W&B panels: (title, history key) and
# (title, summary key)
CURVES = [
    ("train loss", "train/loss"),
    ("val accuracy", "val/acc"),
    ("loss scale", "amp/loss_scale"),
]
BARS = [
    ("throughput (samples/s)", "mean_samples_per_s"),
    ("peak memory (MB)", "peak_memory_mb"),
    ("skipped steps", "skipped_steps"),
    ("final loss scale", "final_loss_scale"),
]


def _panels(wr: Any, axis: Any) -> list[Any]:
    """Curves grouped by the axis (mean, min-max band over seeds), the figures as bars."""
    curves = {"groupby": axis, "groupby_aggfunc": "mean", "groupby_rangefunc": "minmax"}
    return [
        *[
            wr.LinePlot(title=t, x="step", y=[key], log_y=key == "amp/loss_scale", **curves)
            for t, key in CURVES
        ],
        *[wr.BarPlot(title=t, metrics=[wr.SummaryMetric(key)], groupby=axis) for t, key in BARS],
    ]


def build_report(
    project: str,
    entity: str,
    sweeps: list[str],
    data: dict[str, Any],
    leaves: list[str],
    run_ids: tuple[str, ...] | list[str] = (),
) -> Any:
    """The Report object: per comparison group its verdict and panels, then parallel
    coordinates over `leaves`."""
    import wandb_workspaces.reports.v2 as wr

    where = [f"Metric('Group') == '{sweep}'" for sweep in sweeps]
    where += [f"Metric('ID') == '{i}'" for i in run_ids]
    source = "(" + " or ".join(where) + ")" if where else ""
    varying = [k for k in data["axis_keys"] if k in leaves] or data["axis_keys"][:1]
    axis = wr.Config(varying[0])
    blocks: list[Any] = [
        wr.H1(f"amp_lab comparison along {data['axis']}"),
        wr.MarkdownBlock(data["rules"]),
    ]
    for group in data["groups"]:
        settings = {k: v for k, v in group["settings"].items() if v != "—"}
        filters = [source] if source else []
        filters += [f"Config('{k}') == {_literal(v)}" for k, v in settings.items()]
        runset = wr.Runset(
            entity=entity,
            project=project,
            name=f"group {group['id']}",
            filters=" and ".join(filters),
            groupby=[f"config.{key}" for key in [*settings, *varying]],  # the run table's
        )
        blocks += [
            wr.H2(f"Group {group['id']}: {group['name']}"),
            wr.MarkdownBlock(
                f"**Reference:** {group['reference']}\n\n**Verdict:** {group['verdict']}"
            ),
            wr.PanelGrid(runsets=[runset], panels=_panels(wr, axis)),
        ]
    columns = [wr.ParallelCoordinatesPlotColumn(metric=wr.Config(key)) for key in leaves]
    columns += [
        wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(name))
        for name in ("final_val_acc", "final_val_loss", "mean_samples_per_s", "skipped_steps")
    ]
    blocks += [
        wr.H2("All runs"),
        wr.PanelGrid(
            runsets=[wr.Runset(entity=entity, project=project, name="all runs", filters=source)],
            panels=[wr.ParallelCoordinatesPlot(title="settings that vary", columns=columns)],
        ),
    ]
    return wr.Report(
        project=project,
        entity=entity,
        title=f"amp_lab comparison: {', '.join(sweeps) or f'{len(run_ids)} runs'}",
        description=f"{len(data['groups'])} comparison groups along "
        f"{data['axis']} (amp_lab report).",
        blocks=blocks,
    )


def report_spec(report: Any) -> str:
    """The report in the library's own serialisation: the view `save()` sends (its `spec` is
    what is uploaded), as JSON; `load_spec` reads it back."""
    return report._to_model().model_dump_json(by_alias=True, exclude_none=True, indent=2)


def load_spec(text: str) -> Any:
    """A spec `report_spec` wrote, as a wandb_workspaces Report again."""
    import wandb_workspaces.reports.v2 as wr
    from wandb_workspaces.reports.v2.internal import ReportViewspec

    return wr.Report._from_model(ReportViewspec.model_validate_json(text))


def _api() -> Any:
    """The W&B API, or None when W&B is forced offline or no API key is configured."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return None
    import wandb

    try:
        return wandb.Api()
    except Exception:  # noqa: BLE001 - no key or no server: stay offline
        return None


def publish(runs: list[RunData], data: dict[str, Any], out: Path, console: Console) -> Path | None:
    """Save the report online and print its URL; offline, write its spec and say how to publish."""
    logger = runs[0].config.get("logger", {})
    project, entity = logger.get("project") or "amp_lab", logger.get("entity") or ""
    groups, run_ids = run_groups(runs)
    leaves = varying_leaves(runs)
    if (api := _api()) is not None:
        try:
            online_entity = entity or api.default_entity or ""
            report = build_report(project, online_entity, groups, data, leaves, run_ids)
            report.save()
            console.print(f"W&B report: {report.url}")
            return None
        except Exception as err:  # noqa: BLE001 - fall back to the offline spec
            console.print(f"W&B report could not be saved ({redact(str(err))}); writing its spec")
    # offline the entity is left empty: a run set with one looks its project up on the server.
    # Published, it is logger.entity or the API key's default entity.
    report = build_report(project, "", groups, data, leaves, run_ids)
    path = out / SPEC_FILE
    path.write_text(report_spec(report) + "\n")
    syncs = " ".join(sorted({f"{run.path.parent}/*/wandb/offline-run-*" for run in runs}))
    console.print(  # the runs first: the report's run sets find them by group and id
        f"W&B report spec written to {path} (offline); to publish it (WANDB_API_KEY set, "
        f"WANDB_MODE not offline): wandb sync {syncs} && {data['context']['report_command']}",
        soft_wrap=True,
    )
    return path
