"""Loss scalers, all torch's GradScaler with only update() differing.

Every mode runs through a GradScaler, so the step reads the same for all of them and a
non-finite step is skipped and counted rather than written into the weights. Modes without
dynamic scaling get a StaticGradScaler pinned at 1.0; `scaler.kind=static` is the same class at a
chosen scale, `scaler.kind=hysteresis` the DeepSpeed-style scaler of hysteresis.py.
"""

from __future__ import annotations

import torch
from torch.amp import GradScaler

from amp_lab.config import ScalerConfig
from amp_lab.precision.hysteresis import HysteresisGradScaler
from amp_lab.precision.modes import PrecisionPolicy


class StaticGradScaler(GradScaler):
    """A GradScaler whose scale never moves: skipping works, backoff and growth do not."""

    def __init__(self, device: str, scale: float) -> None:
        super().__init__(device, init_scale=scale)
        self._fixed_scale = scale

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(self._fixed_scale if new_scale is None else new_scale)


def uses_dynamic_scaling(cfg: ScalerConfig, policy: PrecisionPolicy) -> bool:
    """scaler.enabled=None follows the precision mode; true/false overrides it."""
    if cfg.kind == "static":
        return False
    return policy.mode.dynamic_scaling if cfg.enabled is None else cfg.enabled


def allowed_holds(cfg: ScalerConfig) -> int:
    """Skipped steps in a row that may keep the scale: the hysteresis scaler's hysteresis - 1,
    else 0 (every other dynamic scaler backs off at each skip)."""
    return cfg.hysteresis - 1 if cfg.kind == "hysteresis" else 0


def build_scaler(cfg: ScalerConfig, policy: PrecisionPolicy) -> GradScaler:
    """The scaler the config asks for; modes that need no scaling get a static scale of 1."""
    device = policy.device.type
    if cfg.kind == "static":  # a fixed scale, whatever the mode (false: none at all)
        return StaticGradScaler(device, scale=cfg.init_scale if cfg.enabled is not False else 1.0)
    if not uses_dynamic_scaling(cfg, policy):
        return StaticGradScaler(device, scale=1.0)
    if cfg.kind == "hysteresis":
        return HysteresisGradScaler(
            device,
            cfg.init_scale,
            cfg.growth_factor,
            cfg.backoff_factor,
            cfg.growth_interval,
            cfg.hysteresis,
            cfg.min_scale,
            cfg.max_scale,
        )
    return GradScaler(
        device,
        init_scale=cfg.init_scale,
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval,
    )


def scaler_stop_reason(scaler: GradScaler) -> str | None:
    """Why the scaler says the run cannot go on (host sync: call at log steps only), or None."""
    if isinstance(scaler, HysteresisGradScaler) and scaler.floor_reached():
        return (
            f"overflow with the loss scale at scaler.min_scale={scaler.min_scale:g}: "
            "loss scaling cannot help any more"
        )
    return None
