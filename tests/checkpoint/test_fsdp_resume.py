"""trainer.strategy=fsdp stopped by a signal and rerun: two gloo ranks resume from their sharded
checkpoint and log what an uninterrupted run logs, at every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import settings
from helpers.distributed import as_rank, free_port
from helpers.resume import RUN, SignalAt, curve, rows

from amp_lab.build import build
from amp_lab.checkpoint.signals import Interrupted
from amp_lab.trainer import Trainer

# fp16 with a short growth interval: the scale moves, so a lost growth tracker would show
FSDP_FP16 = [
    *RUN,
    "trainer.strategy=fsdp",
    "trainer.batch_size=8",
    "precision=fp16",
    "scaler.init_scale=1024",
    "scaler.growth_interval=3",
]
STOP_AT = 5


def _runs(rank: int, port: int, runs: list[tuple[str, int | None]]) -> None:
    """mp.spawn worker: the runs one after the other, each in a process group of its own."""
    as_rank(rank, port)
    torch.set_num_threads(1)
    for run_dir, stop_at in runs:
        _run(rank, run_dir, stop_at)


def _run(rank: int, run_dir: str, stop_at: int | None) -> None:
    # the signal reaches rank 0 alone; the ranks agree on it at that (log) step
    sinks = [SignalAt(stop_at)] if stop_at is not None and rank == 0 else []
    trainer = Trainer(build(settings(*FSDP_FP16), run_dir), sinks)
    start = (trainer.run.state.step, trainer.run.scaler.get_scale())
    try:
        trainer.fit()
    except Interrupted as stopped:
        Path(run_dir, f"stopped_rank{rank}.txt").write_text(str(stopped))
    # this rank's shards (the process group is gone after fit): the same split on every run
    weights = torch.cat([p.to_local().flatten() for p in trainer.run.model.parameters()])
    torch.save(
        {"start": start, "scale": trainer.run.scaler.get_scale(), "weights": weights},
        Path(run_dir, f"rank{rank}_{start[0]}.pt"),
    )


def _spawn(*runs: tuple[Path, int | None]) -> None:
    """Two ranks that run each (run folder, step to stop at) in turn."""
    jobs = [(str(run_dir), stop_at) for run_dir, stop_at in runs]
    mp.spawn(_runs, args=(free_port(), jobs), nprocs=2, join=True)


@pytest.mark.slow
def test_fsdp_run_stopped_by_a_signal_resumes_exactly_on_two_ranks(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    _spawn((whole, None), (split, STOP_AT))  # the uninterrupted run, then the stopped one
    for rank in (0, 1):  # both ranks stopped after the checkpoint of step 5
        assert f"at step {STOP_AT}" in (split / f"stopped_rank{rank}.txt").read_text()
    assert [p.name for p in (split / "checkpoints").iterdir()] == [f"step_{STOP_AT:09d}.dcp"]
    assert max(r["step"] for r in rows(split)) == STOP_AT
    interrupted = json.loads((split / "summary.json").read_text())
    assert interrupted["status"].startswith(f"interrupted: SIGUSR2 at step {STOP_AT}")

    _spawn((split, None))  # the rerun in the same directory, by fresh processes
    for rank in (0, 1):
        resumed = torch.load(split / f"rank{rank}_{STOP_AT}.pt")
        scale_at_stop = torch.load(split / f"rank{rank}_0.pt")["scale"]
        assert resumed["start"] == (STOP_AT, scale_at_stop)  # each rank from the checkpoint
        uninterrupted = torch.load(whole / f"rank{rank}_0.pt")
        assert resumed["scale"] == uninterrupted["scale"]
        torch.testing.assert_close(resumed["weights"], uninterrupted["weights"], rtol=0, atol=1e-6)
    # losses, LR, loss scale, skipped steps and val loss at every logged step; no gap, no repeat
    assert curve(split) == curve(whole)
    train = [r for r in rows(whole) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert len({r["amp/loss_scale"] for r in train}) > 1  # the scale moved across the stop
    summary = json.loads((split / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    # the run directory holds the uninterrupted run's records, and the checkpoint folder
    records = {p.name for p in whole.iterdir() if not p.name.startswith("rank")}
    ours = {p.name for p in split.iterdir() if not p.name.startswith(("rank", "stopped"))}
    assert ours == records | {"checkpoints"}
