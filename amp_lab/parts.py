"""The parts a Trainer builds from its settings, handed to the tools as one dataclass.

The benchmarks (amp_lab/bench/) time the runner's own step on its own data with these; they
read nothing else of the Trainer. Built in this order by `Trainer.__init__` (each needs the
one before): data -> model -> optimizer -> policy.prepare (16-bit weights, fp32 masters in the
optimizer's param groups; returns the hook the step needs) -> schedule, scaler -> the step
(its class chosen first, the pitfall lab's variant if asked; it captures the param groups and
builds its numerics observer from its own view).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.amp import GradScaler

from amp_lab.components.data import DataSource, EpochBatchSampler
from amp_lab.config import AmpLabConfig
from amp_lab.precision.modes import PrecisionPolicy
from amp_lab.step import TrainStep


@dataclass(frozen=True)
class BuiltParts:
    """What one run trains with, built and ready; `train_step` is the loop's own step."""

    settings: AmpLabConfig
    device: torch.device
    policy: PrecisionPolicy
    data: DataSource
    sampler: EpochBatchSampler  # this rank's share of each epoch
    model: torch.nn.Module  # the plain module: not DDP-wrapped, not compiled
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: GradScaler
    train_step: TrainStep
    steps_per_epoch: int  # optimizer steps
    global_batch: int  # samples per optimizer step over all ranks
    peak_lr: float
