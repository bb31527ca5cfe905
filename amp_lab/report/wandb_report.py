"""The comparison as a W&B Report (wandb-workspaces): saved online, or its spec as JSON offline.

The run set is the sweep's W&B group (one per multirun directory); panels: train loss and val
accuracy grouped by precision, loss scale and skipped steps, throughput and memory bars, and
parallel coordinates over the swept keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from amp_lab.records import WANDB_ID_FILE
from amp_lab.report.runs import RunData, differing_keys
from amp_lab.tracking.wandb_sink import redact, sweep_group

if TYPE_CHECKING:
    from wandb_workspaces.reports.v2.interface import PanelTypes

SPEC_FILE = "wandb_report.json"
BY_PRECISION = "precision.name"  # the config key every run has


def run_groups(runs: list[RunData]) -> tuple[list[str], list[str]]:
    """(W&B groups, ids of runs in no group), as tracking set them: logger.group, else the sweep
    directory for multirun jobs (Hydra writes multirun.yaml there); a single run has no group."""
    groups, loose = [], []
    for run in runs:
        group = run.config.get("logger", {}).get("group")
        if group is None and (run.path.parent / "multirun.yaml").exists():
            group = sweep_group(run.path)
        if group is not None:
            groups.append(group)
        elif (run.path / WANDB_ID_FILE).exists():
            loose.append((run.path / WANDB_ID_FILE).read_text().strip())
    return list(dict.fromkeys(groups)), loose


def build_report(project: str, entity: str, groups: list[str], swept: list[str],
                 table_md: str, run_ids: tuple[str, ...] | list[str] = ()) -> Any:
    """The Report object: one run set per group (and one for single runs), the comparison panels,
    the local table."""
    import wandb_workspaces.reports.v2 as wr

    runsets = [wr.Runset(entity=entity, project=project, name=f"sweep {group}",
                         filters=f"Metric('Group') == '{group}'") for group in groups]
    if run_ids:
        runsets.append(wr.Runset(entity=entity, project=project, name="single runs",
                                 filters=" or ".join(f"Metric('ID') == '{i}'" for i in run_ids)))
    by_precision = wr.Config(BY_PRECISION)
    columns = [wr.ParallelCoordinatesPlotColumn(metric=wr.Config(key)) for key in swept]
    columns += [wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(name))
                for name in ("best_val_acc", "mean_samples_per_s", "skipped_steps")]
    panels: list[PanelTypes] = [
        wr.LinePlot(title="train loss by precision", x="step", y=["train/loss"],
                    groupby=by_precision, groupby_aggfunc="mean", groupby_rangefunc="minmax"),
        wr.LinePlot(title="train loss vs training time", x="time_s", y=["train/loss"],
                    groupby=by_precision, groupby_aggfunc="mean", groupby_rangefunc="minmax"),
        wr.LinePlot(title="val accuracy", x="step", y=["val/acc"], groupby=by_precision,
                    groupby_aggfunc="mean", groupby_rangefunc="minmax"),
        wr.LinePlot(title="loss scale and skipped steps", x="step",
                    y=["amp/loss_scale", "amp/skipped_steps"], log_y=True),
        wr.BarPlot(title="throughput (samples/s)",
                   metrics=[wr.SummaryMetric("mean_samples_per_s")], groupby=by_precision),
        wr.BarPlot(title="peak memory (MB)", metrics=[wr.SummaryMetric("peak_memory_mb")],
                   groupby=by_precision),
        wr.ParallelCoordinatesPlot(title="swept keys", columns=columns),
    ]
    return wr.Report(
        project=project, entity=entity,
        title=f"amp_lab comparison: {', '.join(groups) or f'{len(run_ids)} runs'}",
        description="Precision modes and scaler/LR settings side by side (amp_lab.report).",
        blocks=[wr.H1("Runs"), wr.MarkdownBlock(table_md),
                wr.PanelGrid(runsets=runsets, panels=panels)])


def report_spec(report: Any) -> dict[str, Any]:
    """The report as plain JSON data (what `save()` would publish)."""
    import pydantic

    return pydantic.TypeAdapter(type(report)).dump_python(report, mode="json")


def _online() -> bool:
    """True when W&B is not forced offline and an API key is configured."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return False
    import wandb

    try:
        wandb.Api()
    except Exception:  # noqa: BLE001 - no key or no server: stay offline
        return False
    return True


def publish(runs: list[RunData], out: Path, table_md: str, console: Console) -> Path | None:
    """Save the report online and print its URL; offline, write its spec and say how to publish."""
    logger = runs[0].config.get("logger", {})
    project, entity = logger.get("project") or "amp_lab", logger.get("entity") or ""
    swept = differing_keys(runs)
    groups, run_ids = run_groups(runs)
    if _online():
        import wandb

        try:
            online_entity = entity or wandb.Api().default_entity or ""
            report = build_report(project, online_entity, groups, swept, table_md, run_ids)
            report.save()
            console.print(f"W&B report: {report.url}")
            return None
        except Exception as err:  # noqa: BLE001 - fall back to the offline spec
            console.print(f"W&B report could not be saved ({redact(str(err))}); writing its spec")
    report = build_report(project, entity, groups, swept, table_md, run_ids)
    path = out / SPEC_FILE
    path.write_text(json.dumps(report_spec(report), indent=2) + "\n")
    syncs = " ".join(sorted({f"{run.path.parent}/*/wandb/offline-run-*" for run in runs}))
    console.print(f"W&B is offline: report spec written to {path}.\nTo publish it: "
                  f"`wandb sync {syncs}`, then rerun this command with --wandb online "
                  "(WANDB_API_KEY set, WANDB_MODE not offline).")
    return path
