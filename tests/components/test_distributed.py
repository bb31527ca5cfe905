"""DistributedDataParallel on CPU with gloo and two processes, as torchrun and SLURM start it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import run_cli, settings
from helpers.distributed import as_rank, free_port, torchrun
from helpers.slurm import JOB, ON_TEST_CLUSTER

from amp_lab.build import build
from amp_lab.components.distributed import world_from_environment
from amp_lab.trainer import Trainer

COMMON = [
    "model=test_vit",
    "data.img_size=16",
    "trainer.max_steps=6",
    "trainer.log_every=2",
    "trainer.progress=false",
    "trainer.device=cpu",
    "trainer.timing_warmup=1",
    "logger.mode=disabled",
]


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if r["kind"] == "train"]


def test_world_from_torchrun_and_slurm_environments(monkeypatch):
    for key in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"]:
        monkeypatch.delenv(key, raising=False)
    assert world_from_environment()["world_size"] == 1
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-node7")
    world = world_from_environment()
    assert (world["rank"], world["local_rank"], world["world_size"]) == (3, 1, 4)
    assert world["master_addr"] == "gpu-node7" and world["master_port"] == 20000 + 12345
    monkeypatch.setenv("RANK", "1")  # torchrun's variables win over SLURM's
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert world_from_environment()["world_size"] == 2


@pytest.mark.slow
def test_torchrun_ddp_matches_single_process_with_the_same_global_batch(tmp_path):
    ddp = torchrun(
        *COMMON, "trainer.strategy=ddp", "trainer.batch_size=8", "hydra.run.dir=ddp", cwd=tmp_path
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    # rank 0 speaks for the run: another rank's line lands inside rank 0's progress bar
    said = ddp.stdout + ddp.stderr
    assert "(rank 0 of 2)" in said and "(rank 1 of 2)" not in said
    assert said.count("precision audit:") == 1
    # the reference in this process: the CLI's own run is tested elsewhere
    Trainer(build(settings(*COMMON, "trainer.batch_size=16"), tmp_path / "one")).fit()
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["lr"]["global_batch"] == 16
    assert _losses(tmp_path / "ddp") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)
    rows = (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == len((tmp_path / "one" / "metrics.jsonl").read_text().splitlines())
    last_train = [json.loads(r) for r in rows if '"kind": "train"' in r][-1]
    assert last_train["throughput/samples_per_s_per_device"] == pytest.approx(
        last_train["throughput/samples_per_s"] / 2
    )
    peak, total = last_train["memory/peak_mb"], last_train["memory/peak_mb_total"]
    assert peak < total <= 2 * peak  # the largest rank's peak, and the sum over both ranks


def _inf_run(rank: int, out_dir: str) -> None:
    trainer = Trainer(
        build(
            settings(
                "precision=fp16",
                "scaler.init_scale=1024",
                "trainer.strategy=ddp",
                "trainer.batch_size=8",
                "trainer.max_steps=4",
                "trainer.log_every=1",
            ),
            out_dir,
        )
    )
    if rank == 1:  # an inf in one rank's gradients at its second step
        calls = {"n": 0}

        def hook(grad):
            calls["n"] += 1
            return grad * float("inf") if calls["n"] == 2 else grad

        trainer.run.model.head.weight.register_hook(hook)
    summary = trainer.fit()
    weights = torch.cat([p.detach().flatten() for p in trainer.run.model.parameters()])
    torch.save(
        {
            "skipped": summary["skipped_steps"],
            "scale": trainer.run.scaler.get_scale(),
            "weights": weights,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def _first_runs_worker(rank: int, ports: tuple[int, int], out_dir: str) -> None:
    """The runs of the tests below on one pair of spawned ranks (a spawn costs each rank an
    import of torch): the inf run, then the resume test's first run, each with a rendezvous
    port of its own (a rank done first would otherwise join the group its peer is closing)."""
    torch.set_num_threads(1)
    as_rank(rank, ports[0])
    _inf_run(rank, os.path.join(out_dir, "inf"))
    as_rank(rank, ports[1])
    _resume_run(rank, os.path.join(out_dir, "resume"))


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("ddp")
    for name in ("inf", "resume"):
        (out_dir / name).mkdir()
    ports = (free_port(), free_port())
    mp.spawn(_first_runs_worker, args=(ports, str(out_dir)), nprocs=2, join=True)
    return out_dir


@pytest.mark.slow
def test_an_inf_on_one_rank_makes_every_rank_skip(first_runs):
    tmp_path = first_runs / "inf"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == 1
    assert ranks[0]["scale"] == ranks[1]["scale"] == 512.0  # 1024 x backoff, on both ranks
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["amp/skipped_steps"] for r in rows if r["kind"] == "train"] == [0, 1, 1, 1]


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_two_task_slurm_job_trains_with_ddp(tmp_path, monkeypatch):
    """tasks_per_node=2 through the submitit launcher: one DDP world of two SLURM tasks."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = run_cli(
        "-m",
        "trainer.strategy=ddp",
        "hydra/launcher=submitit_slurm",
        *ON_TEST_CLUSTER,
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=5",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *JOB,
        "trainer.batch_size=8",
        "trainer.max_steps=4",
        "trainer.log_every=2",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = [p for p in (tmp_path / "sweep").iterdir() if p.name.startswith("0")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["lr"]["global_batch"] == 16 and summary["steps"] == 4
    assert [
        json.loads(r)["step"]
        for r in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"kind": "train"' in r
    ] == [2, 4]  # rank 0 alone wrote, once per log step


def _resume_run(rank: int, out_dir: str) -> None:
    trainer = Trainer(
        build(
            settings(
                "precision=fp16",
                "trainer.strategy=ddp",
                "trainer.batch_size=8",
                "trainer.max_steps=6",
                "trainer.log_every=1",
                "checkpoint.every_steps=3",
                "checkpoint.every_minutes=0",
            ),
            out_dir,
        )
    )
    with open(os.path.join(out_dir, f"start_rank{rank}.txt"), "a") as f:
        # where each rank starts
        f.write(f"{trainer.run.state.step} {trainer.run.scaler.get_scale()}\n")
    trainer.fit()


def _rerun_worker(rank: int, port: int, out_dir: str) -> None:
    as_rank(rank, port)
    _resume_run(rank, out_dir)


@pytest.mark.slow
def test_ddp_run_resumes_on_every_rank_from_rank_0s_checkpoint(first_runs):
    """Rank 0 writes the checkpoint; a rerun in the same directory resumes every rank from it."""
    tmp_path = first_runs / "resume"
    first = _losses(tmp_path)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000000003.pt"]
    (tmp_path / "summary.json").unlink()  # as if killed before the end: not a finished run
    mp.spawn(_rerun_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert _losses(tmp_path) == first  # steps 4-6 retrained from the step-3 state: identical
    starts = [(tmp_path / f"start_rank{r}.txt").read_text().split("\n")[:2] for r in range(2)]
    assert [s[0].split()[0] for s in starts] == ["0", "0"]  # the first run starts fresh
    assert [s[1].split()[0] for s in starts] == ["3", "3"]  # the rerun: both ranks at step 3
    assert starts[0][1] == starts[1][1]  # with the same loss scale
