"""Low-precision model weights: an fp32 master copy in the optimizer, or rounded fp32 updates.

BatchNorm's weights stay fp32, as in apex O2: a running variance averaged in 16 bits drifts.
`MasterWeights` (apex O2) steps fp32 copies; `RoundedUpdates` (bf16 without masters) steps an fp32
up-cast rounded back to nearest, stochastically, or with a bf16 Kahan buffer (Zamirai et al. 2020).
"""

from __future__ import annotations

from typing import Any

import torch

KAHAN_COMP = "kahan_comp"  # optimizer-state key of the Kahan compensation buffer (bf16)


def to_low_precision(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The model's weights in `dtype`, BatchNorm's (weights and running stats) kept in fp32."""
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.float()


class MasterWeights:
    """fp32 master copies held by the optimizer; the model keeps the 16-bit weights."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype
    ) -> None:
        if optimizer.state:
            raise RuntimeError("master weights must be set up before the first optimizer step")
        self.model_params: list[torch.Tensor] = []  # the 16-bit weights the model computes with
        self.masters: list[torch.Tensor] = []
        for group in optimizer.param_groups:  # the fp32 masters replace the model's parameters
            masters = [torch.nn.Parameter(p.detach().clone().float()) for p in group["params"]]
            self.model_params += group["params"]
            self.masters += masters
            group["params"] = masters
        to_low_precision(model, dtype)  # the model's own Parameter objects: 16-bit weights
        optimizer.register_step_post_hook(lambda *_: self.copy_masters_out())
        optimizer.register_state_dict_post_hook(self._save_masters)
        optimizer.register_load_state_dict_pre_hook(self._load_masters)

    def copy_grads_in(self) -> None:
        """Before unscale_: move the model's (scaled, 16-bit) gradients into fp32 master grads."""
        for param, master in zip(self.model_params, self.masters):
            # fp32 before unscaling: an fp16 gradient divided by the scale could underflow
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    @torch.no_grad()
    def copy_masters_out(self) -> None:
        """After a step: the updated masters, rounded to nearest, become the model's weights."""
        torch._foreach_copy_(self.model_params, self.masters)

    def _save_masters(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        # A checkpoint of the 16-bit model alone would lose the masters' low bits.
        state_dict["master_params"] = [m.detach() for m in self.masters]
        return state_dict

    def _load_masters(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        state_dict = dict(state_dict)
        saved = state_dict.pop("master_params", None)
        if saved is not None:
            with torch.no_grad():
                torch._foreach_copy_(
                    self.masters, [s.to(m.device) for s, m in zip(saved, self.masters)]
                )
            self.copy_masters_out()
        return state_dict


def stochastic_round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to bf16 up or down with probability given by the distance (unbiased)."""
    bits = x.contiguous().view(torch.int32)
    # bf16 keeps the upper 16 bits of an fp32; adding uniform noise to the lower 16 and
    # truncating rounds away from zero with probability (dropped bits) / 2**16.
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class RoundedUpdates:
    """No masters: every step runs in fp32 on an up-cast and is rounded back into bf16."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dtype: torch.dtype,
        rounding: str,
    ) -> None:
        self.optimizer, self.dtype, self.rounding = optimizer, dtype, rounding
        to_low_precision(model, dtype)  # the optimizer's Parameter objects are the model's
        self.low = [p for g in optimizer.param_groups for p in g["params"] if p.dtype == dtype]
        optimizer.register_step_pre_hook(lambda *_: self._to_fp32())
        optimizer.register_step_post_hook(lambda *_: self._round_back())
        # load_state_dict casts the state to each parameter's dtype: load it against fp32
        # parameters, so the fp32 moments keep their bits, then go back to 16 bits.
        optimizer.register_load_state_dict_pre_hook(lambda *_: self._params_to(torch.float32))
        optimizer.register_load_state_dict_post_hook(lambda *_: self._params_to(dtype))

    def _comp(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return self.optimizer.state.get(param, {}).get(KAHAN_COMP)

    @torch.no_grad()
    def _to_fp32(self) -> None:
        for p in self.low:
            comp = self._comp(p)
            # Kahan: the optimizer starts from weight + the rounding error carried so far
            p.data = p.data.float() if comp is None else p.data.float() + comp.float()
            if p.grad is not None:
                p.grad = p.grad.float()

    @torch.no_grad()
    def _round_back(self) -> None:
        for p in self.low:
            exact = p.data
            if self.rounding == "stochastic":
                p.data = stochastic_round_to_bf16(exact)
            else:
                p.data = exact.to(self.dtype)
            if self.rounding == "kahan":
                # what rounding lost this step, kept (in bf16) for the next one
                self.optimizer.state[p][KAHAN_COMP] = (exact - p.data.float()).to(self.dtype)
            if p.grad is not None:
                p.grad = p.grad.to(self.dtype)

    @torch.no_grad()
    def _params_to(self, dtype: torch.dtype) -> None:
        for p in self.low:
            p.data = p.data.to(dtype)  # exact both ways: the values are bf16 numbers
            comp = self._comp(p)
            if comp is not None:
                self.optimizer.state[p][KAHAN_COMP] = comp.to(self.dtype)
