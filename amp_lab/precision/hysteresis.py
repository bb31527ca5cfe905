"""A dynamic loss scaler with DeepSpeed's hysteresis semantics, on torch's GradScaler API.

- hysteresis: the scale backs off only on the N-th consecutive overflow (and on each further
  one); a clean step resets the count (DeepSpeed's `consecutive_hysteresis=True`), so one stray
  inf no longer halves the scale.
- max_scale bounds growth; min_scale bounds backoff, and a backoff due at min_scale means loss
  scaling cannot help: the Trainer stops the run as diverged at its next log step.
At hysteresis=1, with the bounds out of reach, it is torch's GradScaler bit for bit: the scale
times the factor in double, cast to fp32 once; growth when the clean count reaches
growth_interval exactly; no growth to inf. All state is device tensors: no host sync per step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp import GradScaler

from amp_lab.precision.scaler_internals import (
    clear_step_state,
    scale_and_growth_tracker,
    step_found_inf,
)

_EXTRA = ("hysteresis", "min_scale", "max_scale", "_hysteresis_tracker", "_floor_hit")


class HysteresisGradScaler(GradScaler):
    """GradScaler with hysteresis, min_scale (stop) and max_scale; state_dict carries them all."""

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
        if new_scale is not None or not self.is_enabled():
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
        state = super().state_dict()
        if state:
            state.update(
                hysteresis=self.hysteresis,
                min_scale=self.min_scale,
                max_scale=self.max_scale,
                _hysteresis_tracker=int(self._hysteresis_tracker),
                _floor_hit=int(self._floor_hit),
            )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in _EXTRA})
        if not self.is_enabled() or "hysteresis" not in state_dict:
            return  # a plain GradScaler's state: keep this scaler's own settings
        self.hysteresis = state_dict["hysteresis"]
        self.min_scale, self.max_scale = state_dict["min_scale"], state_dict["max_scale"]
        self._hysteresis_tracker = state_dict["_hysteresis_tracker"]
        self._floor_hit = state_dict["_floor_hit"]
