"""The report over real multiruns (`python -m amp_lab -m ...`): a model x precision sweep, a scaler
grid compared `--by scaler.init_scale`, and three launches into one sweep folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import wandb_workspaces.reports.v2 as wr
from helpers import FAST, run_cli
from helpers.reports import cells, report, summary
from helpers.wandb_records import offline_runs, read_run

from amp_lab.tools.report.compare import main
from amp_lab.tools.report.wandb_report import load_spec
from amp_lab.tracking.wandb_sink import sweep_group

pytestmark = pytest.mark.slow
SMALL = [o for o in FAST if not o.startswith(("logger.", "data.img_size", "model="))]


def _sweep(tmp_path: Path, sweep: str, *args: str) -> Path:
    result = run_cli("-m", *args, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    return tmp_path / sweep


def _job(sweep: Path, *parts: str) -> Path:
    [job] = [p for p in sweep.iterdir() if p.is_dir() and all(x in p.name for x in parts)]
    return job


def test_model_by_precision_sweep_compares_each_model_with_its_own_fp32(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sweep = _sweep(
        tmp_path,
        "multirun/2026-11-29/22-00-00",
        "model=test_vit,test_convnext",
        "precision=fp32,bf16",
        "data.img_size=32",
        *SMALL,
        "logger.mode=offline",
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    data = report(str(sweep), "--wandb")
    groups = {g["name"]: g for g in data["groups"]}
    assert set(groups) == {"model.name=test_vit", "model.name=test_convnext"}
    for model, group in groups.items():
        name = model.split("=")[1]
        fp32, bf16 = _job(sweep, f"model={name}", "fp32"), _job(sweep, f"model={name}", "bf16")
        ref = cells(group)["fp32"]
        num = fp32.name.split("_")[0]
        assert group["reference"] == "fp32" and ref["runs"] == [
            f"{num}_model={name},precision=fp32"
        ]
        assert ref["delta"]["acc"]["mean"] == 0.0 and ref["delta"]["speedup"] == 1.0
        delta = cells(group)["bf16"]["delta"]
        assert delta["acc"]["mean"] == pytest.approx(
            summary(bf16)["final_val_acc"] - summary(fp32)["final_val_acc"]
        )
        assert delta["speedup"] == pytest.approx(
            summary(bf16)["mean_samples_per_s"] / summary(fp32)["mean_samples_per_s"]
        )
    assert data["context"]["commands"] == [
        "python -m amp_lab -m model=test_vit,test_convnext precision=fp32,bf16 data.img_size=32 "
        + " ".join(SMALL)
        + " logger.mode=offline"
    ]
    report_obj = load_spec((sweep / "report" / "wandb_report.json").read_text())
    logged = {
        run.run_id: run for job in sweep.iterdir() for run in map(read_run, offline_runs(job))
    }
    assert len(logged) == 4
    group = sweep_group(sweep)  # the folder's last two names and the sweep's own id
    assert group.startswith("2026-11-29/22-00-00-") and {r.group for r in logged.values()} == {
        group
    }
    grids = [block for block in report_obj.blocks if isinstance(block, wr.PanelGrid)]
    assert sorted(g.runsets[0].filters for g in grids[:2]) == [
        f"Metric(\"Group\") == '{group}' and Config(\"model.name\") == '{name}'"
        for name in ("test_convnext", "test_vit")
    ]
    for grid in grids[:2]:
        [runset] = grid.runsets
        model = runset.filters.rsplit("== ", 1)[1].strip("'")
        assert {
            r.config["model"]["name"] for r in logged.values() if _matches(runset.filters, r)
        } == {model}
        assert runset.groupby == ["config.model.value.name", "config.precision.value.name"]
        for key in runset.groupby:  # W&B's nested-config path: section.value.key
            section, _, rest = key.removeprefix("config.").partition(".value.")
            assert all(_config(r, f"{section}.{rest}") is not None for r in logged.values())
        for panel in grid.panels:
            keys = [m.name for m in getattr(panel, "y", None) or panel.metrics]
            where = "history" if isinstance(panel, wr.LinePlot) else "summary"
            for r, key in [(r, k) for r in logged.values() for k in keys]:
                found = (
                    any(key in row for row in r.history) if where == "history" else key in r.summary
                )
                assert found, f"{key} not in the {where} of {r.run_id}"
            assert _config(next(iter(logged.values())), panel.groupby.name) is not None
    [parallel] = grids[2].panels
    for column in parallel.columns:
        for r in logged.values():
            if isinstance(column.metric, wr.Config):
                assert _config(r, column.metric.name) is not None, column.metric.name
            else:
                assert column.metric.name in r.summary, column.metric.name
    assert [c.metric.name for c in parallel.columns[:2]] == ["model.name", "precision.name"]


def _config(run, dotted: str):
    """A dotted key's value in the config a W&B run logged (nested dicts), else None."""
    value = run.config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _matches(filters: str, run) -> bool:
    """Whether a run set's filter (Metric("Group") == '...' and Config("k") == '...') holds for
    a logged run."""
    for term in filters.split(" and "):
        field, _, value = term.partition(" == ")
        kind, name = field.split('("')
        logged = run.group if name == 'Group")' else _config(run, name.removesuffix('")'))
        if str(logged) != value.strip("'"):
            return False
    return True


def test_scaler_grid_by_init_scale_with_default_and_chosen_reference(tmp_path, capsys):
    sweep = _sweep(
        tmp_path,
        "grid",
        "model=test_vit",
        "precision=fp16",
        "scaler.init_scale=1024,65536",
        "scaler.growth_interval=10,100",
        "data.img_size=16",
        *SMALL,
        "logger=disabled",
    )
    by_precision = report(str(sweep))  # all fp16: every group lacks its fp32 reference
    assert len(by_precision["groups"]) == 4
    assert all(g["reference"] is None for g in by_precision["groups"])
    data = report(str(sweep), "--by", "scaler.init_scale")
    assert data["axis_keys"] == ["scaler.init_scale"]
    groups = {g["name"]: g for g in data["groups"]}
    assert set(groups) == {"scaler.growth_interval=10", "scaler.growth_interval=100"}
    for interval, group in groups.items():
        assert group["reference"] == "65536"  # the schema's default init_scale
        low = cells(group)["1024"]
        every = interval.split("=")[1]
        job = _job(sweep, "init_scale=1024,", f"growth_interval={every},")
        num = job.name.split("_")[0]
        assert low["runs"] == [f"{num}_scaler.growth_interval={every},scaler.init_scale=1024"]
        assert low["figures"]["final_loss_scale"]["mean"] == summary(job)["final_loss_scale"]
        assert group["verdict"].startswith("1024 ")
    chosen = report(str(sweep), "--by", "scaler.init_scale", "--ref", "1024")
    assert {g["reference"] for g in chosen["groups"]} == {"1024"}
    capsys.readouterr()
    assert main([str(sweep), "--by", "scaler.initscale"]) == 2
    assert main([str(sweep), "--by", "scaler.init_scale", "--ref", "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("amp_lab report: error: --by scaler.initscale: no run has")
    assert err[1].startswith(
        "amp_lab report: error: --ref 3 is neither a run nor a value of "
        "scaler.init_scale; use a run's label (e.g. "
    )
    assert err[1].endswith(") or one of: 1024, 65536") and len(err) == 2


def test_three_launches_into_one_folder_have_unique_labels_and_pair_seeds(tmp_path):
    args = ["model=test_vit", "data.img_size=16", *SMALL, "logger=disabled"]
    for launch in (
        ["precision=fp32", "trainer.seed=0,1"],
        ["precision=bf16", "trainer.seed=0,1"],
        ["precision=fp16"],
    ):
        sweep = _sweep(tmp_path, "one", *launch, *args)
    data = report(str(sweep))
    labels = [r["label"] for r in data["runs"]]
    assert sorted(labels) == sorted(
        [
            "0_precision=fp32,trainer.seed=0",
            "1_precision=fp32,trainer.seed=1",
            "0_precision=bf16,trainer.seed=0",
            "1_precision=bf16,trainer.seed=1",
            "0_precision=fp16",
        ]
    )
    [group] = data["groups"]
    bf16 = cells(group)["bf16"]
    pairs = [
        summary(_job(sweep, "bf16", f"seed={s}"))["final_val_acc"]
        - summary(_job(sweep, "fp32", f"seed={s}"))["final_val_acc"]
        for s in (0, 1)
    ]
    assert bf16["n"] == 2 and bf16["delta"]["acc"]["n"] == 2 and bf16["delta"]["acc"]["paired"]
    assert bf16["delta"]["acc"]["mean"] == pytest.approx(sum(pairs) / 2)
    assert cells(group)["fp16"]["delta"]["acc"]["n"] == 1  # seed 0 only, paired with fp32's
    relabelled = report(str(sweep), "--ref", "0_precision=fp16")
    assert relabelled["groups"][0]["reference"] == "fp16"
