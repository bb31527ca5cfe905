"""A new user's first hour: honest clocks, threads that follow the CPUs, presets that fit."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import CONF_DIR, ROOT, run_cli, settings

from amp_lab.build import build
from amp_lab.components.threads import plan_threads
from amp_lab.tracking.sinks import Sink
from amp_lab.trainer import Trainer

SLOW_START_S = 1.5


class SlowStart(Sink):
    """A tracker whose start-up takes a while, as W&B's does when it waits for its time-out."""

    def start(self, info: dict) -> None:
        time.sleep(SLOW_START_S)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tracker_start_up_is_setup_not_training_time(tmp_path):
    # target_acc=0: the target is reached at the first evaluation (step 2)
    summary = Trainer(
        build(settings("trainer.eval_every=2", "trainer.target_acc=0"), tmp_path), [SlowStart()]
    ).fit()
    records = _records(tmp_path)
    assert [r["step"] for r in records if r["kind"] == "val"] == [2, 4, 6]
    # every record's time_s, and time-to-target, are on the training clock
    assert max(r["time_s"] for r in records) < SLOW_START_S
    assert summary["steps_to_target"] == 2
    assert summary["time_to_target_s"] < SLOW_START_S
    assert summary["setup_s"] >= SLOW_START_S
    # evaluation is reported apart: the training clock is the loop's wall time less it
    assert summary["eval_s"] > 0
    assert summary["train_time_s"] == pytest.approx(summary["wall_time_s"] - summary["eval_s"])
    assert records[-1]["time_s"] <= summary["train_time_s"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["setup_s"] == pytest.approx(summary["setup_s"])


def test_threads_follow_the_cpus_a_slurm_job_was_given(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))  # a 64-core node
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    plan = plan_threads(threads=0, workers=0)
    assert (plan.cpus, plan.cpus_from, plan.threads) == (2, "SLURM_CPUS_PER_TASK", 2)
    plan = plan_threads(threads=0, workers=4)  # workers capped: the main process keeps a CPU
    assert (plan.workers, plan.threads) == (1, 1)
    assert plan_threads(threads=3, workers=0).threads == 3  # trainer.threads wins
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})  # taskset -c 0-2
    assert plan_threads(threads=0, workers=0).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a choice already made is kept
    assert plan_threads(threads=0, workers=0).threads == 1


def test_the_run_uses_and_records_its_threads(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    try:
        summary = Trainer(
            build(settings("trainer.threads=2", "trainer.max_steps=2"), tmp_path)
        ).fit()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert summary["threads"]["threads"] == 2
    assert summary["threads"]["threads_from"] == "trainer.threads"
    summary = Trainer(
        build(settings("trainer.max_steps=2", "trainer.resume=false"), tmp_path)
    ).fit()
    assert summary["threads"] == {
        "cpus": 1,
        "cpus_from": "SLURM_CPUS_PER_TASK",
        "threads": 1,
        "threads_from": "cpus less workers",
        "workers": 0,
    }


def test_synthetic_data_is_sized_for_a_first_run(tmp_path):
    small = settings("data=synthetic", fast=False).data
    assert (small.name, small.img_size, small.num_classes) == ("synthetic", 32, 10)
    full = settings("data=synthetic_imagenet", fast=False).data
    assert (full.name, full.img_size, full.num_classes) == ("synthetic", 224, 1000)
    summary = Trainer(build(settings("data=synthetic", "data.num_samples=128"), tmp_path)).fit()
    assert summary["status"] == "completed" and summary["data"] == "synthetic"


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}")
    return text[start : text.index("\n## ", start + 1)]


def test_every_option_help_lists_is_in_the_readme_table(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    listing = result.stdout.split("Config groups")[1].split("Current config")[0]
    groups = dict(line.split(": ", 1) for line in listing.splitlines() if ": " in line)
    groups["hydra/launcher"] = ", ".join(
        p.stem for p in (CONF_DIR / "hydra" / "launcher").glob("*.yaml")
    )
    assert {"accum", "model", "experiment/cpu"} <= set(groups)
    rows = [
        line for line in _readme_section("Config groups").splitlines() if line.startswith("| `")
    ]
    for group, options in groups.items():
        [row] = [r for r in rows if f"`{group}`" in r.split("|")[1]]
        missing = [o for o in options.split(", ") if f"`{o}`" not in row]
        assert not missing, (group, missing)


def test_pending_advice_names_the_override_only_when_the_job_cannot_fit(monkeypatch):
    from amp_lab.sweeps import slurm_queue
    from amp_lab.sweeps.slurm_queue import QueuedJob, advice, mem_gb

    assert [mem_gb(t) for t in ("64G", "4000M", "23081", "0", "")] == pytest.approx(
        [64, 3.90625, 22.54, None, None], abs=0.01
    )
    monkeypatch.setattr(slurm_queue, "partition_size", lambda partition: (2, 4.0))
    big = QueuedJob("7_0", "PartitionConfig", 8, 64.0, "debug")
    assert advice([big, replace(big, job_id="7_1")], 61).startswith(
        "SLURM jobs 7_0, 7_1 pending for 61 s (PartitionConfig): each asks 8 CPUs / 64 GB"
    )
    assert advice([big], 61).endswith(
        "asks 8 CPUs / 64 GB; partition debug has 2 CPUs / 4 GB per node: set "
        "hydra.launcher.cpus_per_task / hydra.launcher.mem_gb (or "
        "hydra/launcher=submitit_slurm_cpu on a small cluster)"
    )
    fits = QueuedJob("8", "Resources", 2, None, "debug")
    assert advice([fits], 90) == (
        "SLURM job 8 pending for 90 s (Resources): asks 2 CPUs; "
        "waiting for a free node (squeue -j 8 shows the queue)"
    )
