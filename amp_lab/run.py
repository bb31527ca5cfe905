"""A Run: one run's parts as `build()` made them (amp_lab/build.py), and where its loop stands.

The loop (amp_lab/trainer.py) trains a Run; the bench, the doctor and the tests take one too and
read its parts by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from timm.data import Mixup
from timm.utils import ModelEmaV3
from torch.amp import GradScaler

from amp_lab.audit.audit import PrecisionAudit
from amp_lab.checkpoint.store import Checkpointer
from amp_lab.components.data import DataSource, EpochBatchSampler
from amp_lab.components.distributed import DistContext
from amp_lab.components.fsdp import FsdpPlan
from amp_lab.components.lr import lr_factor
from amp_lab.components.threads import ThreadPlan
from amp_lab.config import AmpLabConfig
from amp_lab.health.monitor import Monitor
from amp_lab.precision.modes import PrecisionPolicy
from amp_lab.precision.scaling import uses_dynamic_scaling
from amp_lab.step import TrainStep
from amp_lab.tracking.sinks import Sink


@dataclass
class LoopState:
    """Where the loop stands: enough to resume at the next optimizer step (it is checkpointed)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # optimizer steps done in the current epoch
    best_val_acc: float | None = None
    final_val_acc: float | None = None
    final_val_loss: float | None = None
    steps_to_target: int | None = None
    time_to_target_s: float | None = None
    elapsed_s: float = 0.0  # wall time of the loop, carried over a resume
    eval_s: float = 0.0  # of elapsed_s, spent evaluating: outside the training clock
    diverged: bool = False


@dataclass(frozen=True)
class Run:
    """Everything one run trains with, built and ready (amp_lab/build.py says by which phase)."""

    # placement
    settings: AmpLabConfig
    out_dir: Path  # rank 0's run directory, on every rank
    threads: ThreadPlan
    dist: DistContext
    device: torch.device
    policy: PrecisionPolicy
    fsdp: FsdpPlan | None
    # data
    data: DataSource
    mixup: Mixup | None
    sampler: EpochBatchSampler  # this rank's share of each epoch
    steps_per_epoch: int  # optimizer steps
    global_batch: int  # samples per optimizer step over all ranks
    total_steps: int
    # model
    model: torch.nn.Module  # the plain module: not DDP-wrapped, not compiled
    # optimization
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    peak_lr: float
    warmup: int  # optimizer steps
    # precision
    scaler: GradScaler
    # step
    train_step: TrainStep  # the loop's own step (wrapped and compiled as built)
    ema: ModelEmaV3 | None
    # monitor
    monitor: Monitor  # the per-step counters and the health judge (amp_lab/health/)
    # resume
    state: LoopState
    checkpointer: Checkpointer
    finished: dict[str, Any] | None  # the summary of a run this directory already finished
    # audit
    audit: PrecisionAudit  # watches the first step this start takes, judges its precision
    # sinks (rank 0 only; none elsewhere)
    sinks: list[Sink]
    started_at: float  # time.perf_counter() when the build began: setup_s counts from here

    def lr_at(self, step: int) -> float:
        """The LR the schedule gives optimizer step `step` (0-based)."""
        return self.peak_lr * lr_factor(step, self.total_steps, self.warmup, self.settings.lr)

    def describe(self) -> dict[str, Any]:
        """The run's resolved settings, as summary.json and the trackers record them."""
        s = self.settings
        return {
            "precision": self.policy.describe(),
            "scaler": {"dynamic": uses_dynamic_scaling(s.scaler, self.policy), **asdict(s.scaler)},
            "lr": {
                "peak": self.peak_lr,
                "base": s.lr.base,
                "rule": s.lr.rule,
                "scale": s.lr.scale,
                "global_batch": self.global_batch,
                "warmup_steps": self.warmup,
                "schedule": s.lr.schedule,
            },
            "model": s.model.name,
            "params": sum(p.numel() for p in self.model.parameters()),
            "data": s.data.name,
            "data_root": s.data.root,  # as resolved (e.g. from ${oc.env:CIFAR_ROOT})
            "world_size": self.dist.world_size,
            **({"fsdp": self.fsdp.describe()} if self.fsdp else {}),
            "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch,
        }
