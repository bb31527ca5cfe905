"""`python -m amp_lab.report`: the table, seed groups, crashed runs, plots, bad input, W&B spec."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from helpers import FAST, run_cli, settings
from helpers.sinks import Boom
from helpers.wandb_records import offline_runs, read_run

from amp_lab.report.compare import main
from amp_lab.report.wandb_report import build_report, report_spec
from amp_lab.trainer import Trainer

SNAPSHOT = Path(__file__).parent / "snapshots" / "wandb_report_spec.json"


def _run(root: Path, name: str, *overrides: str, sinks=None) -> Path:
    """A real run in root/name, with the .hydra/overrides.yaml a Hydra job would write."""
    run_dir = root / name
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    try:
        Trainer(settings(*overrides, "trainer.max_steps=4"), run_dir, sinks=sinks).fit()
    except RuntimeError:
        pass  # a crashed run still leaves its files
    return run_dir


def _table(report_md: str) -> list[list[str]]:
    """The first markdown table of report.md: header, then body rows, split into cells."""
    lines = report_md.split("\n\n| ")[1].split("\n\n")[0].splitlines()
    return [[cell.strip() for cell in line.strip("| ").split("|")] for line in lines]


def _rows(report_md: str) -> list[list[str]]:
    return _table(report_md)[2:]


@pytest.mark.slow
def test_report_groups_seeds_marks_crashes_and_plots(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for num, (precision, seed) in enumerate([("fp32", 0), ("fp32", 1), ("bf16", 0)]):
        _run(sweep, f"{num}_p={precision},s={seed}", f"precision={precision}",
             f"trainer.seed={seed}")
    _run(sweep, "3_crash", "precision=fp16", "trainer.seed=0", sinks=[Boom()])
    assert main([str(sweep)]) == 0
    out = sweep / "report"
    report = (out / "report.md").read_text()
    rows = {row[0]: row for row in _rows(report)}
    assert set(rows) == {"job 0 (ref)", "job 1", "job 2", "job 3"}  # first fp32 is the reference
    header = _table(report)[0]
    assert header[1] == "trainer.seed" and "Δacc vs ref" in header  # the override that differs
    assert rows["job 3"][-1] == "**crashed: RuntimeError: boom**"
    summaries = [json.loads((sweep / f"{i}_p=fp32,s={i}" / "summary.json").read_text())
                 for i in (0, 1)]
    ref_acc = sum(s["final_val_acc"] for s in summaries) / 2  # the fp32 seed group's mean
    bf16 = json.loads((sweep / "2_p=bf16,s=0" / "summary.json").read_text())
    delta = float(rows["job 2"][header.index("Δacc vs ref")])
    assert delta == pytest.approx(bf16["final_val_acc"] - ref_acc, abs=1e-4)
    assert re.search(r"\| precision=fp32 \| 2 \| [\d.]+ ± [\d.e-]+ \|", report)  # seed group
    for name in ["loss_vs_step", "loss_vs_time", "val_acc", "loss_scale", "throughput",
                 "peak_memory", "overview"]:
        assert (out / f"{name}.png").stat().st_size > 5000, name
        assert f"]({name}.png)" in report
    assert "job 3" in capsys.readouterr().out  # the terminal table


@pytest.mark.slow
def test_ref_option_and_bad_input(tmp_path, capsys, monkeypatch):
    run = _run(tmp_path / "runs", "a", "precision=bf16")
    (run / "wandb_run_id").write_text("abc12345\n")  # a single run: no sweep group
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main([str(run), "--ref", "a", "--out", str(tmp_path / "out"), "--wandb"]) == 0
    assert _rows((tmp_path / "out" / "report.md").read_text())[0][0] == "a (ref)"
    spec = json.loads((tmp_path / "out" / "wandb_report.json").read_text())
    [grid] = [block for block in spec["blocks"] if "runsets" in block]
    assert [r["filters"] for r in grid["runsets"]] == ["Metric('ID') == 'abc12345'"]
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not a run")
    for args, message in [([str(tmp_path / "empty")], "holds no amp_lab runs"),
                          ([str(tmp_path / "foreign")], "holds no amp_lab runs"),
                          ([str(tmp_path / "nope")], "is not a directory"),
                          ([str(run), "--ref", "zzz"], "--ref zzz is not one of the runs")]:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("amp_lab.report: error: ") and message in err
        assert err.count("\n") == 1  # one line, no traceback
    assert (run / "summary.json").exists()  # nothing already written is lost


def _normalise(spec: object) -> object:
    """Drop the random panel/run-set ids so the spec compares across builds."""
    if isinstance(spec, dict):
        return {k: _normalise(v) for k, v in spec.items() if k != "_id"}
    if isinstance(spec, list):
        return [_normalise(v) for v in spec]
    return spec


def test_wandb_report_spec_snapshot():
    """The W&B report for a precision x init_scale sweep, built offline, against the snapshot."""
    report = build_report("amp_lab", "my-team", ["2026-11-29/21-40-00"],
                          ["precision", "scaler.init_scale"], "| run | acc |\n|---|---|")
    spec = _normalise(report_spec(report))
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    assert spec == json.loads(SNAPSHOT.read_text())


@pytest.mark.slow
def test_multirun_is_one_wandb_group_and_one_report(tmp_path, monkeypatch):
    """`python -m amp_lab -m precision=fp32,fp16,bf16`: one W&B group, three job types, a report."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    fast = [o for o in FAST if not o.startswith("logger.")]
    result = run_cli("-m", "precision=fp32,fp16,bf16", *fast, "logger.mode=offline",
                     "hydra.sweep.dir=multirun/2026-11-29/22-00-00", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    sweep = tmp_path / "multirun" / "2026-11-29" / "22-00-00"
    runs = [read_run(offline_runs(job)[0]) for job in sorted(sweep.glob("[0-9]_*"))]
    assert {run.group for run in runs} == {"2026-11-29/22-00-00"}
    assert [run.job_type for run in runs] == ["fp32", "fp16", "bf16"]
    assert all(f"precision={run.job_type}" in run.name for run in runs)
    assert all(run.summary["status"] == "completed" and run.exit_code == 0 for run in runs)

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main([str(sweep), "--wandb"]) == 0
    out = sweep / "report"
    rows = _rows((out / "report.md").read_text())
    assert [row[:2] for row in rows] == [["job 0 (ref)", "fp32"], ["job 1", "fp16"],
                                         ["job 2", "bf16"]]
    assert rows[0][5] == "+0.0000" and rows[0][9] == "1.00×"  # the reference against itself
    assert all((out / f"{name}.png").stat().st_size > 5000 for name in ["loss_vs_step",
               "loss_scale", "throughput", "overview"])
    spec = json.loads((out / "wandb_report.json").read_text())
    [grid] = [block for block in spec["blocks"] if "runsets" in block]
    assert grid["runsets"][0]["filters"] == "Metric('Group') == '2026-11-29/22-00-00'"
    [parallel] = [panel for panel in grid["panels"] if "columns" in panel]
    assert parallel["columns"][0]["metric"]["name"] == "precision"


@pytest.mark.slow
def test_damaged_and_unfinished_runs_are_read_as_far_as_they_go(tmp_path, caplog):
    sweep = tmp_path / "sweep"
    killed = _run(sweep, "0_p=fp32,s=0", "precision=fp32", "trainer.seed=0")
    _run(sweep, "1_p=fp32,s=1", "precision=fp32", "trainer.seed=1")
    damaged = _run(sweep, "2_p=bf16,s=0", "precision=bf16", "trainer.seed=0")
    (killed / "summary.json").unlink()  # killed before its summary: the metrics hold the rest
    (damaged / "summary.json").write_text('{"status": "compl')  # cut short on a full disk
    (damaged / ".hydra" / "config.yaml").write_text("precision: [unclosed")
    with (damaged / "metrics.jsonl").open("a") as f:
        f.write("[1, 2]\n")  # valid JSON, not a record
    with (damaged / "metrics.jsonl").open("ab") as f:
        f.write(b"\xff\xfe\n")  # not even UTF-8
    with caplog.at_level("WARNING", logger="amp_lab.report.runs"):
        assert main([str(sweep)]) == 0
    assert "summary.json is unreadable" in caplog.text and "config.yaml is unreadable" in \
        caplog.text
    rows = {row[0]: row for row in _rows((sweep / "report" / "report.md").read_text())}
    header = _table((sweep / "report" / "report.md").read_text())[0]
    assert "job 1 (ref)" in rows  # the finished fp32 run, not the killed one
    final_acc = [r["val/acc"] for r in map(json.loads, (killed / "metrics.jsonl").read_text()
                                           .splitlines()) if r["kind"] == "val"][-1]
    killed_row = rows["job 0"]
    assert float(killed_row[header.index("final acc")]) == pytest.approx(final_acc, abs=1e-4)
    assert killed_row[-1] == "**incomplete: no summary.json**"
    assert rows["job 2"][header.index("Δacc vs ref")] != "—"  # read from its metrics
    assert rows["job 2"][header.index("precision")] == "bf16"  # from its overrides.yaml
    refused = sweep / "3_p=fp16,s=0" / ".hydra"  # a job refused at start-up: .hydra/ only
    refused.mkdir(parents=True)
    (refused / "overrides.yaml").write_text(yaml.safe_dump(["precision=fp16", "trainer.seed=0"]))
    (sweep / "1_p=fp32,s=1" / "summary.json").unlink()  # no completed fp32 run is left
    assert main([str(sweep)]) == 0
    report = (sweep / "report" / "report.md").read_text()
    rows = {row[0]: row for row in _rows(report)}
    assert rows["job 3"][-1] == "**not started: no records (refused, or never ran)**"
    assert "No reference (no completed fp32 run; pass --ref RUN)" in report
