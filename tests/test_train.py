"""Whole runs: every precision mode trains, the files a run writes, divergence, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import run_cli, settings

from amp_lab.build import build
from amp_lab.components.metrics import peak_memory_mb
from amp_lab.trainer import Trainer

TRAIN_KEYS = {
    "train/loss",
    "train/acc",
    "train/lr",
    "train/grad_norm",
    "amp/loss_scale",
    "amp/skipped_steps",
    "amp/skip_rate",
    "throughput/samples_per_s",
    "throughput/step_ms",
    "throughput/data_share",
    "memory/peak_mb",
}


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16", "fp16_noscale", "bf16"])
def test_every_precision_mode_trains(precision, tmp_path):
    summary = Trainer(
        build(
            settings(
                f"precision={precision}",
                "model=test_convnext",
                "data.img_size=32",
                "trainer.max_steps=30",
                "trainer.log_every=10",
                "lr.base=3e-3",
            ),
            tmp_path,
        )
    ).fit()
    rows = _rows(tmp_path)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30]
    assert all(TRAIN_KEYS <= r.keys() for r in train)
    assert all(r["train/grad_norm"] > 0 for r in train)  # measured on every log step
    assert train[-1]["train/loss"] < train[0]["train/loss"]  # it learns
    assert summary["status"] == "completed" and summary["diverged"] is False
    assert summary["final_val_acc"] > 0.3  # 10 classes: chance is 0.1
    assert summary["precision"]["name"] == precision
    assert summary["skipped_steps"] == 0
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


@pytest.mark.slow
def test_summary_holds_what_the_issue_names(tmp_path):
    summary = Trainer(
        build(
            settings(
                "trainer.max_steps=6",
                "trainer.eval_every=3",
                "trainer.target_acc=0.0",
                "lr.scale=0.5",
            ),
            tmp_path,
        )
    ).fit()
    for key in [
        "final_val_acc",
        "best_val_acc",
        "steps_to_target",
        "time_to_target_s",
        "mean_samples_per_s",
        "skipped_steps",
        "diverged",
        "wall_time_s",
        "precision",
        "scaler",
        "lr",
        "peak_memory_mb",
    ]:
        assert summary[key] is not None, key
    assert summary["steps_to_target"] == 3  # first evaluation already meets a 0.0 target
    assert summary["lr"]["peak"] == pytest.approx(0.5e-3)
    assert [r["step"] for r in _rows(tmp_path) if r["kind"] == "val"] == [3, 6]
    assert summary["mean_samples_per_s"] > 0


@pytest.mark.slow
def test_peak_memory_is_each_runs_own_in_a_shared_process(tmp_path):
    """A local sweep runs its jobs in one process: an earlier job's peak must not carry over."""
    cpu = torch.device("cpu")
    ballast = torch.ones(64 * 2**20)  # 256 MiB touched, then freed: a big earlier job
    del ballast
    earlier_peak = peak_memory_mb(cpu)
    summary = Trainer(build(settings(), tmp_path)).fit()
    assert 0 < summary["peak_memory_mb"] < earlier_peak - 128


@pytest.mark.slow
def test_same_seed_same_run_other_seed_other_run(tmp_path):
    def losses(seed, name):
        Trainer(build(settings(f"trainer.seed={seed}"), tmp_path / name)).fit()
        return [r["train/loss"] for r in _rows(tmp_path / name) if r["kind"] == "train"]

    assert losses(0, "a") == losses(0, "b")
    assert losses(0, "a") != losses(1, "c")


@pytest.mark.slow
def test_epochs_cover_the_data_and_evaluate_each_epoch(tmp_path):
    summary = Trainer(
        build(
            settings(
                "trainer.max_steps=0",
                "trainer.epochs=2",
                "trainer.batch_size=256",
                "trainer.log_every=100",
            ),
            tmp_path,
        )
    ).fit()
    assert summary["steps_per_epoch"] == 1438 // 256 and summary["steps"] == 2 * 5
    assert [r["step"] for r in _rows(tmp_path) if r["kind"] == "val"] == [5, 10]


@pytest.mark.slow
def test_divergence_stops_cleanly(tmp_path):
    """An absurd LR sends the weights to inf; every later step is skipped, then the run stops."""
    result = run_cli(
        "precision=fp32",
        "lr.base=1e30",
        "lr.schedule=constant",
        "trainer.max_steps=40",
        "health.max_bad_steps=3",
        "trainer.log_every=2",
        "trainer.progress=false",
        "model=test_vit",
        "data.img_size=16",
        "trainer.batch_size=16",
        "trainer.device=cpu",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["diverged"] is True and summary["status"] == "diverged"
    assert summary["steps"] < 40 and summary["skipped_steps"] >= 3
    out = result.stderr + result.stdout
    assert "consecutive skipped steps (>= health.max_bad_steps=3)" in out
    assert f"run health: {summary['health'][0]['words']}" in out  # the end line, its words


@pytest.mark.slow
def test_the_users_command_starts_at_the_chosen_scale(tmp_path):
    result = run_cli(
        "precision=fp16",
        "scaler.init_scale=32768",
        "trainer.max_steps=3",
        "trainer.log_every=1",
        "model=test_vit",
        "data.img_size=16",
        "trainer.batch_size=16",
        "trainer.device=cpu",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    assert (run / ".hydra" / "config.yaml").is_file()
    train = [r for r in _rows(run) if r["kind"] == "train"]
    assert train[0]["amp/loss_scale"] == 32768.0
    assert all(math.isfinite(r["train/loss"]) for r in train)
    assert json.loads((run / "summary.json").read_text())["scaler"]["init_scale"] == 32768.0


@pytest.mark.slow
def test_default_experiment_reaches_90_percent_on_digits(tmp_path):
    """What `make run` does, on CPU: the default config, untouched."""
    result = run_cli("trainer.device=cpu", "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_val_acc"] >= 0.90
    assert "amp_lab run summary" in result.stderr
