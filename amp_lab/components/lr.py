"""Learning-rate scaling, warmup and schedules, as pure functions of the optimizer step.

The step counter advances on skipped steps too, so a run always ends its schedule at its last step.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from amp_lab.config import LRConfig


def peak_lr(cfg: LRConfig, global_batch: int) -> float:
    """base x batch-size rule (against ref_batch, counting accumulation) x scale."""
    ratio = global_batch / cfg.ref_batch
    rule = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.rule]
    return cfg.base * rule * cfg.scale


def warmup_length(cfg: LRConfig, steps_per_epoch: int) -> int:
    if cfg.warmup_steps > 0:
        return cfg.warmup_steps
    return round(cfg.warmup_epochs * steps_per_epoch)


def lr_factor(step: int, total_steps: int, warmup: int, cfg: LRConfig) -> float:
    """Multiplier on the peak LR for optimizer step `step` (0-based)."""
    if cfg.schedule == "onecycle" and warmup == 0:
        warmup = round(0.3 * total_steps)  # 1cycle's usual 30% ramp when no warmup is set
    if step < warmup:
        t = step / warmup
        ramp = t if cfg.warmup_type == "linear" else (1 - math.cos(math.pi * t)) / 2
        return cfg.warmup_init + (1 - cfg.warmup_init) * ramp
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    low = cfg.min_factor
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        return low + (1 - low) * (1 + math.cos(math.pi * progress)) / 2
    if cfg.schedule == "onecycle":
        return 1.0 - (1 - low) * progress  # linear anneal, as in Smith's 1cycle
    every = cfg.step_every or max(1, (total_steps - warmup) // 3)
    return cfg.step_gamma ** ((step - warmup) // every)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRConfig, total_steps: int, steps_per_epoch: int
) -> LambdaLR:
    """A LambdaLR over the optimizer's peak LR; call .step() once per optimizer step."""
    warmup = warmup_length(cfg, steps_per_epoch)
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, warmup, cfg))
