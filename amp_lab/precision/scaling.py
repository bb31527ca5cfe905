"""Loss scalers, all torch's GradScaler with only update() differing.

Every mode runs through one, so a non-finite step is skipped and counted in every mode; modes
without dynamic scaling get a StaticGradScaler at 1.0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp import GradScaler

from amp_lab.config import ScalerConfig
from amp_lab.precision.modes import PrecisionPolicy
from amp_lab.precision.scaler_internals import (
    clear_step_state,
    scale_and_growth_tracker,
    step_found_inf,
)


class StaticGradScaler(GradScaler):
    """A GradScaler whose scale never moves: skipping works, backoff and growth do not."""

    def __init__(self, device: str, scale: float) -> None:
        super().__init__(device, init_scale=scale)
        self._fixed_scale = scale

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(self._fixed_scale if new_scale is None else new_scale)


class HysteresisGradScaler(GradScaler):
    """GradScaler with DeepSpeed's hysteresis (`consecutive_hysteresis=True`): the scale backs off
    only from the N-th consecutive overflow on; max_scale and min_scale bound it, and a backoff due
    at min_scale stops the run. At hysteresis=1 within the bounds it is torch's, bit for bit."""

    def __init__(
        self,
        device: str,
        init_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        min_scale: float,
        max_scale: float,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        self.hysteresis, self.min_scale, self.max_scale = hysteresis, min_scale, max_scale
        # device tensors from the first update() on (the scale's device is known only then);
        # ints before it and after load_state_dict
        self._hysteresis_tracker: torch.Tensor | int = hysteresis  # overflows left before a backoff
        self._floor_hit: torch.Tensor | int = 0  # 1 once a backoff was due at min_scale

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Once per optimizer step, after step(): apply hysteresis, growth and the bounds."""
        if new_scale is not None:
            super().update(new_scale)
            return
        scale, growth = scale_and_growth_tracker(self)
        found = [f.to(scale.device, non_blocking=True) for f in step_found_inf(self)]
        if not found:
            raise AssertionError("No inf checks were recorded prior to update.")
        overflow = torch.stack(found).sum() > 0
        tracker = torch.as_tensor(self._hysteresis_tracker, dtype=torch.int32, device=scale.device)
        left = torch.where(overflow, tracker - 1, self.hysteresis)
        backoff = overflow & (left <= 0)
        # a backoff due while already at the floor: loss scaling has run out of room
        floor_hit = torch.as_tensor(self._floor_hit, dtype=torch.int32, device=scale.device)
        self._floor_hit = floor_hit | (backoff & (scale <= self.min_scale)).int()
        grown = growth + 1
        due = ~overflow & (grown == self.get_growth_interval())  # torch's test: `==`
        # as torch's kernel: the fp32 scale times the factor in double, rounded to fp32 once
        larger = (scale.double() * self.get_growth_factor()).float()
        smaller = (scale.double() * self.get_backoff_factor()).float()
        grow = due & larger.isfinite()  # torch never grows the scale to inf
        new = torch.where(backoff, smaller, torch.where(grow, larger, scale))
        scale.copy_(new.clamp(self.min_scale, self.max_scale))
        growth.copy_(torch.where(overflow | due, 0, grown))
        self._hysteresis_tracker = left.clamp(min=0)
        clear_step_state(self)

    def floor_reached(self) -> bool:
        """True once a backoff was due at min_scale (a host sync: call at log steps only)."""
        return bool(self._floor_hit)

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "_hysteresis_tracker": int(self._hysteresis_tracker),
            "_floor_hit": int(self._floor_hit),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Also a plain GradScaler's state: own settings kept, overflows left full, no floor hit."""
        super().load_state_dict(state_dict)  # GradScaler reads its keys only, not the ones below
        self.hysteresis = state_dict.get("hysteresis", self.hysteresis)
        self.min_scale = state_dict.get("min_scale", self.min_scale)
        self.max_scale = state_dict.get("max_scale", self.max_scale)
        self._hysteresis_tracker = state_dict.get("_hysteresis_tracker", self.hysteresis)
        self._floor_hit = state_dict.get("_floor_hit", 0)


def uses_dynamic_scaling(cfg: ScalerConfig, policy: PrecisionPolicy) -> bool:
    """scaler.enabled=None follows the precision mode; true/false overrides it."""
    if cfg.kind == "static":
        return False
    return policy.mode.dynamic_scaling if cfg.enabled is None else cfg.enabled


def allowed_holds(cfg: ScalerConfig) -> int:
    """Skipped steps in a row that may keep the scale: hysteresis - 1 for that scaler, else 0."""
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
