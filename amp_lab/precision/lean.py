"""LeanGradScaler: torch's GradScaler, with the Python it runs per parameter and per step cut.

torch's `unscale_()` sorts the gradients by device and dtype in a Python loop over every
parameter, and its `step()` inspects the optimizer's signature and sums the inf/nan flags on
every call. With a fused optimizer on one device (amp_lab's default) none of that changes
between steps, so this scaler checks it once per optimizer and then runs torch's own kernel and
hand-over directly (scaler_internals.unscale_in_one_call, step_fused_unscaled): the same ops on
the same tensors, bit for bit. Anything else (several devices or dtypes, sparse or fp16
gradients, an optimizer that is not fused, step() with arguments) goes through torch's code.
On test_convnext's ~20 ms CPU step the two calls took ~0.25 ms less (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp import GradScaler

from amp_lab.precision.scaler_internals import step_fused_unscaled, unscale_in_one_call


class LeanGradScaler(GradScaler):
    """GradScaler whose unscale_() and step() take torch's kernel calls without its Python
    sorting whenever the optimizer's gradients allow it."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not unscale_in_one_call(self, optimizer):
            super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self.is_enabled() and not args and not kwargs:
            done, retval = step_fused_unscaled(self, optimizer)
            if done:
                return retval
        return super().step(optimizer, *args, **kwargs)
