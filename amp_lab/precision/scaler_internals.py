"""Every use of torch GradScaler's private state, in one place.

torch's public GradScaler API has no device-side view of the inf/nan flag `unscale_` leaves, of
the scale tensor, or of a scale update outside `update()`. amp_lab needs all three without a
host sync: the step reports skipped updates, the diagnostics record the scale every step, the
hysteresis scaler replaces `update()`, and the pitfall lab updates the scale per micro-batch on
purpose. These functions were checked against the torch versions in CHECKED_TORCH
(tests/precision/test_scaler_internals.py fails on any other major.minor until they are re-checked).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, NamedTuple

import torch
from torch.amp import GradScaler
from torch.amp.grad_scaler import OptState

# torch major.minor versions whose GradScaler source these functions were read against
CHECKED_TORCH = ("2.14",)
# what to re-read in torch/amp/grad_scaler.py before adding a version to CHECKED_TORCH
RECHECK = (
    "GradScaler._per_optimizer_states[id(optimizer)]['found_inf_per_device'] (written "
    "by unscale_, cleared by update), _get_scale_async(), _check_scale_growth_tracker(), "
    "the update() body (torch._amp_update_scale_ on _scale and _growth_tracker), "
    "torch._amp_foreach_non_finite_check_and_unscale_, and the unscale_()/_unscale_grads_() and "
    "step()/_maybe_opt_step() bodies that unscale_in_one_call and step_unscaled restate (OptState, "
    "the inv_scale computation, optimizer.grad_scale/found_inf for _step_supports_amp_scaling)"
)


def torch_major_minor(version: str = torch.__version__) -> str:
    """'2.14' for '2.14.1+cu130'."""
    return ".".join(version.split("+")[0].split(".")[:2])


def found_inf(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """1.0 if `scaler.step(optimizer)` just skipped the update, else 0.0: the inf/nan flag that
    unscale_ left on the device (no sync). Read it between step() and update(), which clears it."""
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
    """The scale as the device tensor (reading it is no sync); None while disabled or before the
    first scale()."""
    return scaler._get_scale_async()


def scale_and_growth_tracker(scaler: GradScaler) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and the count of clean steps since the last change, device tensors to update
    in place; raises if scale() was never called."""
    return scaler._check_scale_growth_tracker("update")


def update_scale_now(scaler: GradScaler, grads: list[torch.Tensor]) -> None:
    """Back off or grow the scale now from `grads` (checked for inf/nan as they are), with
    update()'s own kernel, but keep this step's records: the pitfall lab's per-micro-batch
    update."""
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


class FastPaths(NamedTuple):
    """What an optimizer allows, found once for its parameter count."""

    params: int  # the parameter count it was checked with
    one_call: bool  # one kernel call can unscale all its gradients
    fused_step: bool  # its step skips itself on the device flag


_FAST_PATHS: weakref.WeakKeyDictionary[torch.optim.Optimizer, FastPaths] = (
    weakref.WeakKeyDictionary()
)


def _fast_paths(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> FastPaths:
    """The optimizer's FastPaths, checked once per optimizer and parameter count. One call
    needs what torch's grouping would find: every parameter with a dense gradient, all on one
    device in one dtype other than fp16.
    The device-side skip needs a fused optimizer (`_step_supports_amp_scaling`) that does not
    take the deprecated `grad_scaler` argument."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    known = _FAST_PATHS.get(optimizer)
    if known is None or known.params != count:
        kinds = {(g.device, g.dtype) for g in grads}
        one_call = (
            len(grads) == count
            and len(kinds) == 1
            and next(iter(kinds))[1] != torch.float16
            and not any(g.is_sparse for g in grads)
        )
        fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
            "grad_scaler" not in inspect.signature(optimizer.step).parameters
        )
        known = _FAST_PATHS[optimizer] = FastPaths(count, one_call, fused)
    return known


def unscale_in_one_call(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """`scaler.unscale_(optimizer)` as torch does it, with torch's kernel and torch's inverse
    scale, in one call over all gradients; False, with nothing done, when the gradients are not
    dense, fp16, or of one device and dtype (then torch's unscale_ must run). torch first sorts
    the gradients by device and dtype in Python, per parameter and per step: on a CPU step of
    ~20 ms that sorting cost about as much as the kernel."""
    if not scaler.is_enabled():
        return False
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads or not _fast_paths(optimizer, grads).one_call:
        return False
    scaler._check_scale_growth_tracker("unscale_")
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is not OptState.READY:
        return False  # torch's unscale_ raises the right error
    scale = scaler._scale
    assert scale is not None
    inv_scale = scale.double().reciprocal().float()  # as torch computes it
    flag = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale)
    state["found_inf_per_device"] = {flag.device: flag}
    state["stage"] = OptState.UNSCALED
    return True


def flag_read_on_host(flag: torch.Tensor) -> bool:
    """Whether step_unscaled decides the skip on the host: where the flag is on a CPU, so reading
    it waits for nothing."""
    return flag.device.type == "cpu"


def step_unscaled(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> tuple[bool, Any]:
    """`scaler.step(optimizer)` after `unscale_in_one_call`, as torch does it, without its
    per-step signature inspection and flag sum; (False, None), with nothing done, when this
    optimizer's flags need torch's own step().

    On a CPU the flag is read on the host, as torch does for an optimizer without a fused kernel:
    reading it waits for nothing there, and a skipped step is then not run at all. Handing the
    flag to the fused kernel instead costs a step-count fix-up per parameter on every step
    (torch's `_foreach_sub_`: 70 us of a 20 ms test_convnext step). Elsewhere a fused optimizer
    gets the flag on the device, so the host never waits for the GPU."""
    state = scaler._per_optimizer_states[id(optimizer)]
    flags = state["found_inf_per_device"]
    if state["stage"] is not OptState.UNSCALED or len(flags) != 1:
        return False, None
    flag = next(iter(flags.values()))
    known = _FAST_PATHS.get(optimizer)
    on_host = flag_read_on_host(flag)
    if known is None or not (on_host or known.fused_step):
        return False, None
    scaler._check_scale_growth_tracker("step")
    if on_host:
        retval = None if flag.item() else optimizer.step()
    else:
        optimizer.grad_scale = getattr(optimizer, "grad_scale", None)  # type: ignore[attr-defined]
        optimizer.found_inf = flag  # type: ignore[attr-defined]
        retval = optimizer.step()
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]
    state["stage"] = OptState.STEPPED
    return True, retval
