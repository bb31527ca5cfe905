"""Interrupt a run at a step and compare what runs logged (checkpoint/resume tests)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from amp_lab.build import build
from amp_lab.checkpoint.signals import Interrupted
from amp_lab.tracking.sinks import Sink
from amp_lab.trainer import Trainer
from helpers.compose import settings

# 12 logged steps, an evaluation every 4 on a small val set; no time-based checkpoints
RUN = [
    "trainer.max_steps=12",
    "trainer.log_every=1",
    "trainer.eval_every=4",
    "data.val_fraction=0.05",
    "checkpoint.every_minutes=0",
]


class SignalAt(Sink):
    """Sends a signal (`times` times) to this very process when the train record of `step` is
    logged."""

    def __init__(self, step: int, signum: int = signal.SIGUSR2, times: int = 1) -> None:
        self.step, self.signum, self.times = step, signum, times

    def log(self, record: dict) -> None:
        if record["kind"] == "train" and record["step"] == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def rows(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def curve(run_dir: Path) -> list[tuple]:
    """Everything that must match between runs: losses, LR, loss scale, val figures."""
    return [
        (
            r["kind"],
            r["step"],
            r.get("train/loss"),
            r.get("train/lr"),
            r.get("amp/loss_scale"),
            r.get("amp/skipped_steps"),
            r.get("val/loss"),
        )
        for r in rows(run_dir)
    ]


def interrupt(
    run_dir: Path, overrides: list[str], at_step: int, signum: int = signal.SIGUSR2
) -> Interrupted:
    """Train until the signal at `at_step` stops the run (after its checkpoint)."""
    with pytest.raises(Interrupted) as stopped:
        Trainer(build(settings(*overrides), run_dir), [SignalAt(at_step, signum)]).fit()
    return stopped.value
