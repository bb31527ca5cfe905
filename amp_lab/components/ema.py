"""A model EMA (timm's ModelEmaV3), kept in fp32 whatever the weights' dtype.

An update moves it by (1 - decay) x (weights - ema), 1e-4 of the difference at decay 0.9999: in
bf16 a change under 2**-8 of a weight near 1 rounds away, so a bf16 EMA stops moving.
`trainer.ema.fp32=false` keeps the weights' dtype with plain rounding, to show the trap.
"""

from __future__ import annotations

import torch
from timm.utils import ModelEmaV3

from amp_lab.config import EmaConfig


def build_ema(model: torch.nn.Module, cfg: EmaConfig) -> ModelEmaV3 | None:
    """The EMA copy of `model` (after the precision policy has cast it), or None when off."""
    if cfg.decay == 0.0:
        return None
    # stochastic rounding off: with fp32=false the trap shows as it would in a hand-written EMA
    return ModelEmaV3(
        model, decay=cfg.decay, dtype=torch.float32 if cfg.fp32 else None, stochastic_rounding=False
    )


def update_ema(ema: ModelEmaV3 | None, model: torch.nn.Module, cfg: EmaConfig, step: int) -> None:
    """After optimizer step `step` (1-based): one EMA update every `cfg.every` steps, no sync."""
    if ema is not None and step % cfg.every == 0:
        ema.update(model)  # the fixed decay: the EMA starts as the initial weights
