"""LeanGradScaler: torch's GradScaler, with the Python it runs per parameter and per step cut.

torch's `unscale_()` sorts the gradients by device and dtype in a Python loop over every
parameter, and its `step()` inspects the optimizer's signature and sums the inf/nan flags on
every call. With a fused optimizer on one device (amp_lab's default) none of that changes
between steps, so this scaler checks it once per optimizer and then runs torch's own kernel and
skip directly (scaler_internals.unscale_in_one_call, step_unscaled): on a GPU the fused
optimizer reads the flag on the device; on a CPU the flag is read on the host, as torch does for
an optimizer without a fused kernel. The same updates of the same tensors, bit for bit.
Anything else (several devices or dtypes, sparse or fp16 gradients, on a GPU an optimizer that
is not fused, step() with arguments) goes through torch's code. On test_convnext's ~20 ms CPU
step the two calls took ~0.3 ms less (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp import GradScaler

from amp_lab.precision.scaler_internals import step_unscaled, unscale_in_one_call


class LeanGradScaler(GradScaler):
    """GradScaler whose unscale_() and step() take torch's kernel calls without its Python
    sorting whenever the optimizer's gradients allow it."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not unscale_in_one_call(self, optimizer):
            super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self.is_enabled() and not args and not kwargs:
            done, retval = step_unscaled(self, optimizer)
            if done:
                return retval
        return super().step(optimizer, *args, **kwargs)
