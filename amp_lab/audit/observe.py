"""What one training step really did, seen from inside it: per module the weights' dtype at
forward, the output's dtype and whether autocast was on; the GEMM FLOPs per dtype; the loss's
dtype at backward, whether the scaler scaled it and unscaled the gradients before clipping; the
gradients' dtypes as backward left them.

`StepWatch` is entered around one call of the training step and undoes everything on exit: the
global module hooks, the dispatch mode and the wrappers on the step's stages and the scaler's
methods are gone, so the next step runs exactly as an unwatched one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch.amp import GradScaler
from torch.utils._pytree import tree_flatten

from amp_lab.audit.gemm_flops import GemmFlops
from amp_lab.precision.modes import dtype_name
from amp_lab.step import TrainStep


@dataclass
class ModuleSeen:
    """One module's first forward call in the watched step."""

    params: str | None  # its own weights' dtype(s) as the forward saw them (FSDP: gathered)
    output: str | None  # its first tensor output's dtype
    autocast: bool  # autocast was on when it was called (fp32_modules turn it off inside)


@dataclass
class StepSeen:
    """Everything a watched step showed; gemm_flops is (module, dtype) -> FLOPs."""

    modules: dict[str, ModuleSeen] = field(default_factory=dict)
    gemm_flops: dict[tuple[str, str], int] = field(default_factory=dict)
    grads: dict[str, str] = field(default_factory=dict)  # parameter -> gradient dtype
    loss_dtype: str | None = None
    scale: float | None = None  # the loss scale this step scaled by; None: the scaler is off
    events: list[str] = field(default_factory=list)  # scale, unscale, clip: in the order they ran


def _dtypes(tensors: list[torch.Tensor]) -> str | None:
    names = sorted({dtype_name(t.dtype) for t in tensors})
    return ",".join(names) or None


def _first_tensor(output: Any) -> torch.Tensor | None:
    leaves, _ = tree_flatten(output)
    return next((t for t in leaves if isinstance(t, torch.Tensor)), None)


def _noting(
    call: Callable, note: Callable[..., None] | None, counter: GemmFlops | None
) -> Callable[..., Any]:
    """`call`, first telling `note` its arguments, then running under `counter` if given."""

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        if note is not None:
            note(*args, **kwargs)
        with counter or contextlib.nullcontext():
            return call(*args, **kwargs)

    return run


class StepWatch:
    """Observe the steps run inside `with StepWatch(step, model, scaler) as seen:`."""

    def __init__(self, step: TrainStep, model: torch.nn.Module, scaler: GradScaler) -> None:
        self.step, self.model, self.scaler = step, model, scaler
        self.names = {m: name for name, m in model.named_modules()}
        self.device_type = step.policy.device.type
        self.seen = StepSeen()

    def _module_done(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(module)
        if name is None or name in self.seen.modules:
            return
        out = _first_tensor(output)
        self.seen.modules[name] = ModuleSeen(
            params=_dtypes(list(module.parameters(recurse=False))),
            output=None if out is None else dtype_name(out.dtype),
            autocast=torch.is_autocast_enabled(self.device_type),
        )

    def _grads_now(self, *_: Any) -> None:
        """The gradients as backward left them (before the pure modes move them to masters)."""
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                self.seen.grads.setdefault(name, dtype_name(p.grad.dtype))

    def _backward(self, loss: torch.Tensor) -> None:
        self.seen.loss_dtype = self.seen.loss_dtype or dtype_name(loss.dtype)

    def _event(self, name: str) -> Callable[..., None]:
        return lambda *_, **__: self.seen.events.append(name)

    @contextlib.contextmanager
    def watching(self) -> Iterator[StepSeen]:
        """Inside: the step's calls are watched; what they showed fills the StepSeen yielded."""
        step, scaler = self.step, self.scaler
        # read before the step: a fresh scaler's scale is its init_scale, no device read
        self.seen.scale = float(scaler.get_scale()) if scaler.is_enabled() else None
        counter = GemmFlops(self.model)
        # (object, method, what to note before each call, under the FLOP counter): the forward
        # and the backward are counted, not the optimizer (torchao's optimizers compile their
        # step, which a dispatch mode would prevent)
        watched: list[tuple[object, str, Callable[..., None] | None, bool]] = [
            (step, "forward_and_loss", None, True),
            (step, "backward", self._backward, True),
            (step, "before_unscale", self._grads_now, False),
            (step, "norm_and_clip", self._event("clip"), False),
            (scaler, "scale", self._event("scale"), False),
            (scaler, "unscale_", self._event("unscale"), False),
        ]
        try:
            with contextlib.ExitStack() as undo:
                hook = torch.nn.modules.module.register_module_forward_hook(self._module_done)
                undo.callback(hook.remove)
                undo.enter_context(counter.tracking_modules())
                for obj, name, note, counted in watched:
                    call = _noting(getattr(obj, name), note, counter if counted else None)
                    # on this instance only: on exit the class's method shows through again
                    undo.enter_context(mock.patch.object(obj, name, call))
                yield self.seen
        finally:
            self.seen.gemm_flops = dict(counter.flops)
        self._grads_now()  # a step that never calls before_unscale (the pitfall lab's)
