"""W&B tracking, checked against what the run really wrote to W&B's own offline files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers import settings
from helpers.sinks import Boom
from helpers.wandb_records import offline_runs, read_run

from amp_lab.config import ConfigError
from amp_lab.records import WANDB_ID_FILE
from amp_lab.tracking.wandb_sink import WandbSink, build_tracking_sinks, resolve_mode
from amp_lab.trainer import Trainer

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 hex characters, like a real key


def _jsonl(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == kind]


def _no_key_anywhere(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_run_logs_config_identity_history_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    summary = Trainer(settings("logger.mode=offline", "logger.group=study-a", "precision=bf16",
                               "scaler.init_scale=32768", "lr.scale=0.7", "+logger.tags=[mine]"),
                      tmp_path).fit()
    [wandb_file] = offline_runs(tmp_path)
    run = read_run(wandb_file)
    assert run.run_id == (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert (run.project, run.group, run.job_type) == ("amp_lab", "study-a", "bf16")
    assert {"model:test_vit", "precision:bf16", "mine"} <= set(run.tags)
    # nested keys, searchable as precision.name, scaler.init_scale, lr.scale in W&B
    assert run.config["precision"]["name"] == "bf16"
    assert run.config["scaler"]["init_scale"] == 32768
    assert run.config["lr"]["scale"] == 0.7
    assert run.config["resolved"]["lr"]["peak"] == pytest.approx(0.7e-3)
    assert "logger" in run.config and FAKE_KEY not in json.dumps(run.config)
    # every metrics.jsonl record is a W&B history row, plotted against `step`
    train = [row for row in run.history if "train/loss" in row]
    assert [row["step"] for row in train] == [r["step"] for r in _jsonl(tmp_path, "train")]
    assert [row["train/loss"] for row in train] == pytest.approx(
        [r["train/loss"] for r in _jsonl(tmp_path, "train")])
    assert [row["val/acc"] for row in run.history if "val/acc" in row] == pytest.approx(
        [r["val/acc"] for r in _jsonl(tmp_path, "val")])
    assert {run.metrics[f"{p}/*"] for p in ("train", "val", "amp", "throughput")} == {"step"}
    assert run.summary["final_val_acc"] == pytest.approx(summary["final_val_acc"])
    assert run.summary["status"] == "completed" and run.summary["precision"]["name"] == "bf16"
    assert run.exit_code == 0
    _no_key_anywhere(tmp_path)


@pytest.mark.slow
def test_resumed_job_continues_the_same_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (tmp_path / WANDB_ID_FILE).write_text("resume01\n")  # as a checkpoint restores it
    every = "checkpoint.every_steps=2"
    with pytest.raises(RuntimeError, match="boom"):  # dies at step 4, after its checkpoint at 2
        Trainer(settings("logger.mode=offline", every), tmp_path, sinks=[Boom()]).fit()
    Trainer(settings("logger.mode=offline", every), tmp_path).fit()  # the requeued one finishes
    files = offline_runs(tmp_path)
    assert len(files) == 2 and {read_run(f).run_id for f in files} == {"resume01"}


@pytest.mark.slow
def test_crashed_run_is_finished_with_its_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(settings("logger.mode=offline"), tmp_path, sinks=[Boom()]).fit()
    run = read_run(offline_runs(tmp_path)[0])
    assert run.summary["status"].startswith("crashed: RuntimeError: boom")
    assert run.exit_code == 1
    assert [row["step"] for row in run.history if "train/loss" in row] == [2]


@pytest.mark.slow
def test_init_failure_falls_back_to_offline(tmp_path, monkeypatch, caplog):
    """Online with an unreachable server: a warning, then an offline run with every metric."""
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "2")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with caplog.at_level(logging.WARNING, logger="amp_lab.tracking.wandb_sink"):
        summary = Trainer(settings("logger.mode=online"), tmp_path).fit()
    assert summary["status"] == "completed"
    assert "W&B online init failed" in caplog.text and "logging offline instead" in caplog.text
    assert FAKE_KEY not in caplog.text
    run = read_run(offline_runs(tmp_path)[0])
    assert [row["step"] for row in run.history if "train/loss" in row] == [2, 4, 6]
    assert run.summary["final_val_acc"] == pytest.approx(summary["final_val_acc"])
    _no_key_anywhere(tmp_path)


@pytest.mark.slow
def test_modes_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_mode(settings("logger.mode=online").logger) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")  # an offline cluster's switch wins
    assert resolve_mode(settings("logger.mode=online").logger) == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")  # but never re-enables a disabled logger
    assert build_tracking_sinks(settings("logger=disabled"), tmp_path) == []
    monkeypatch.setenv("WANDB_MODE", "disabled")
    Trainer(settings("logger.mode=offline", "trainer.max_steps=2"), tmp_path).fit()
    assert not (tmp_path / "wandb").exists() and (tmp_path / "summary.json").exists()
    with pytest.raises(ConfigError, match="logger.mode='onlin' is unknown"):
        settings("logger.mode=onlin")


def test_a_dead_wandb_service_never_replaces_the_runs_own_exit(tmp_path, caplog):
    """On a SLURM requeue, SIGTERM can end the W&B service before the run closes its sink: the
    failure is a warning, so the requeue's SystemExit is what leaves the job."""
    class DeadService:
        def __getattr__(self, name):
            raise ConnectionResetError("Connection lost")

    class DeadRun:
        summary = DeadService()

        def finish(self, exit_code):
            raise ConnectionResetError("Connection lost")

    (tmp_path / "summary.json").write_text('{"status": "interrupted: SIGTERM at step 4"}')
    sink = WandbSink(settings(), tmp_path, "offline")
    sink.run = DeadRun()
    sink.finish({"status": "completed"})
    sink.close()  # raises nothing
    assert sink.run is None
    assert [r.message for r in caplog.records if "W&B" in r.message] == [
        "W&B summary failed (Connection lost)", "W&B finish failed (Connection lost)"]
