"""Loss scalers: torch's dynamic GradScaler, and a fixed-scale one for modes that need no scaling.

Every mode runs through a GradScaler so the training step reads the same for all of them:
`step()` skips an update whose gradients hold inf/nan (without a host sync when the optimizer is
fused), and `update()` adjusts the scale. Modes without dynamic scaling use a StaticGradScaler
pinned at 1.0: nothing is scaled, but a non-finite step is still skipped and counted instead of
being written into the weights.
"""

from __future__ import annotations

import torch
from torch.amp import GradScaler

from amp_lab.config import ScalerConfig
from amp_lab.precision import PrecisionPolicy


class StaticGradScaler(GradScaler):
    """A GradScaler whose scale never moves: skipping works, backoff and growth do not."""

    def __init__(self, device: str, scale: float) -> None:
        super().__init__(device, init_scale=scale)
        self._fixed_scale = scale

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(self._fixed_scale if new_scale is None else new_scale)


def uses_dynamic_scaling(cfg: ScalerConfig, policy: PrecisionPolicy) -> bool:
    """scaler.enabled=None follows the precision mode; true/false overrides it."""
    return policy.mode.dynamic_scaling if cfg.enabled is None else cfg.enabled


def build_scaler(cfg: ScalerConfig, policy: PrecisionPolicy) -> GradScaler:
    device = policy.device.type
    if not uses_dynamic_scaling(cfg, policy):
        return StaticGradScaler(device, scale=1.0)
    return GradScaler(device, init_scale=cfg.init_scale, growth_factor=cfg.growth_factor,
                      backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval)
