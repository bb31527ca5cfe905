"""Every use of torch GradScaler's private state, in one place.

torch's public API has no device-side view of the inf/nan flag, of the scale tensor, or of a scale
update outside `update()`; tests/precision/test_scaler_internals.py fails on a torch major.minor
not in CHECKED_TORCH until these are re-checked.
"""

from __future__ import annotations

import torch
from torch.amp import GradScaler

# torch major.minor versions whose GradScaler source these functions were read against
CHECKED_TORCH = ("2.14",)
# what to re-read in torch/amp/grad_scaler.py before adding a version to CHECKED_TORCH
RECHECK = (
    "GradScaler._per_optimizer_states[id(optimizer)]['found_inf_per_device'] (written "
    "by unscale_, cleared by update), _get_scale_async(), _check_scale_growth_tracker(), "
    "the update() body (torch._amp_update_scale_ on _scale and _growth_tracker, which "
    "HysteresisGradScaler.update restates: the double product cast to fp32 once, growth on "
    "`==`, no growth to inf; also in aten's AmpGradScalerKernels), and "
    "torch._amp_foreach_non_finite_check_and_unscale_"
)


def found_inf(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """1.0 if `scaler.step(optimizer)` just skipped, else 0.0, on the device; update() clears it."""
    flags = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    return flags[0] if len(flags) == 1 else sum(flags)


def step_found_inf(scaler: GradScaler) -> list[torch.Tensor]:
    """The inf/nan flags of every optimizer stepped since the last update(), per device."""
    return [
        flag
        for state in scaler._per_optimizer_states.values()
        for flag in state["found_inf_per_device"].values()
    ]


def clear_step_state(scaler: GradScaler) -> None:
    """Forget this step's unscale/step records, as the end of update() does."""
    scaler._per_optimizer_states.clear()


def scale_tensor(scaler: GradScaler) -> torch.Tensor | None:
    """The scale as a device tensor (no sync); None while disabled or before the first scale()."""
    return scaler._get_scale_async()


def scale_and_growth_tracker(scaler: GradScaler) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and the clean-step count, device tensors to update in place (needs a scale())."""
    return scaler._check_scale_growth_tracker("update")


def update_scale_now(scaler: GradScaler, grads: list[torch.Tensor]) -> None:
    """update()'s kernel now on `grads`' inf/nan check, this step's records kept (pitfalls.py)."""
    scale, growth = scale_and_growth_tracker(scaler)
    flag = torch.zeros((), device=scale.device)
    if grads:  # inv_scale 1: only the check, the gradients keep their values
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, flag, torch.ones((), device=scale.device)
        )
    torch._amp_update_scale_(
        scale,
        growth,
        flag,
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    )


def overflow_update(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """The scaler's own update() for an overflowed step, without unscaling or stepping it."""
    scale, _ = scale_and_growth_tracker(scaler)
    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {scale.device: torch.ones((), device=scale.device)}
    scaler.update()
