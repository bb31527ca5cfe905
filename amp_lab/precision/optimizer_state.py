"""Optimizer-state precision (`optim.state_dtype`): which optimizer keeps Adam's moments in what.

fp32: timm's optimizer. bf16, fp16: `LowPrecisionMomentsAdam` below (no library stores the
moments of fp32 weights in 16 bits). int8, int4, fp8: torchao.optim's block-quantised AdamW/Adam,
which keeps tensors under 4096 values in fp32, as bitsandbytes does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from amp_lab.config import OptimConfig
from amp_lab.precision.master_weights import stochastic_round_to_bf16
from amp_lab.precision.modes import dtype_name
from amp_lab.precision.torchao_extra import import_torchao

CHOSEN_STATE = "amp_lab_state_dtype"  # attribute on an optimizer whose state dtype was chosen
MOMENT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOW_BIT = {"int8": "8bit", "int4": "4bit", "fp8": "Fp8"}  # torchao class-name suffixes


class LowPrecisionMomentsAdam(torch.optim.Optimizer):
    """Adam/AdamW with both moments stored in bf16 or fp16, read as stored; the arithmetic runs
    in fp32. In fp16 a second moment at or below ~3e-8 is 0 (docs/amp_pitfalls.md §3)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.bfloat16,
        stochastic: bool = False,
        decoupled: bool = True,
    ) -> None:
        if stochastic and state_dtype != torch.bfloat16:
            raise ValueError("stochastic rounding of the moments is implemented for bf16 only")
        super().__init__(
            params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        )
        self.state_dtype, self.stochastic, self.decoupled = state_dtype, stochastic, decoupled
        # load_state_dict casts the state to each weight's dtype: put the moments back
        self.register_load_state_dict_post_hook(lambda _: self._moments_to_state_dtype())

    # GradScaler hands over its device inf flag (`self.found_inf`) instead of a host read
    _step_supports_amp_scaling = True

    def _store(
        self, stored: torch.Tensor, target: torch.Tensor, weight: float, skip: torch.Tensor | None
    ) -> torch.Tensor:
        """The moment moved towards `target` in fp32, rounded into storage; returned as fp32."""
        exact = stored.float().lerp_(target, weight)
        new = stochastic_round_to_bf16(exact) if self.stochastic else exact.to(stored.dtype)
        stored.copy_(new if skip is None else torch.where(skip, stored, new))
        return stored.float()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        skip = None if found_inf is None else found_inf > 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), device=p.device)  # device tensor: no sync
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                step = state["step"].add_(1 if skip is None else (~skip).float())
                # a copy: where the step is skipped, p must keep its value
                weight, grad = p.to(torch.float32, copy=True), p.grad.float()
                if grad_scale is not None:  # gradients still scaled: GradScaler did not unscale
                    grad = grad / grad_scale
                if self.decoupled:
                    weight.mul_(1 - lr * decay)
                else:
                    grad = grad.add(weight, alpha=decay)
                m = self._store(state["exp_avg"], grad, 1 - beta1, skip)
                v = self._store(state["exp_avg_sq"], grad.square(), 1 - beta2, skip)
                # clamp: a first step skipped leaves step at 0, whose bias correction is 0
                denom = (v / (1 - beta2**step).clamp_min(1e-30)).sqrt_().add_(group["eps"])
                weight.addcdiv_(m / (1 - beta1**step).clamp_min(1e-30), denom, value=-lr)
                p.copy_(weight if skip is None else torch.where(skip, p, weight))
        return loss

    def _moments_to_state_dtype(self) -> None:
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:  # exact: the values were stored in state_dtype
                    state[key] = state[key].to(self.state_dtype)


def build_state_optimizer(
    groups: list[dict[str, Any]], cfg: OptimConfig, lr: float
) -> torch.optim.Optimizer:
    """The optimizer for a chosen non-fp32 state dtype, over timm's weight-decay groups."""
    kwargs = dict(cfg.kwargs)
    if cfg.state_dtype in MOMENT_DTYPES:
        optimizer: torch.optim.Optimizer = LowPrecisionMomentsAdam(
            groups,
            lr=lr,
            state_dtype=MOMENT_DTYPES[cfg.state_dtype],
            stochastic=cfg.state_rounding == "stochastic",
            decoupled=cfg.name == "adamw",
            **kwargs,
        )
    else:
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        torchao_optim = import_torchao(
            "torchao.optim", f"optim.state_dtype={cfg.state_dtype}", "amp-lab[optim]"
        )
        base = "AdamW" if cfg.name == "adamw" else "Adam"  # torchao.optim.AdamW8bit, Adam4bit...
        optimizer = getattr(torchao_optim, base + LOW_BIT[cfg.state_dtype])(groups, lr=lr, **kwargs)
    setattr(optimizer, CHOSEN_STATE, cfg.state_dtype)
    return optimizer


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a torchao state's codes, scales and code map; a DTensor's shard."""
    if isinstance(t, DTensor):
        return tensor_bytes(t.to_local())
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors but the step counts."""
    return [
        v
        for state in optimizer.state.values()
        for key, v in state.items()
        if torch.is_tensor(v) and key != "step"
    ]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state (host metadata only: no device sync)."""
    return sum(tensor_bytes(v) for v in _state_tensors(optimizer))


def master_weight_bytes(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> int:
    """Bytes of the weights the optimizer steps that are not the model's own (fp32 masters)."""
    own = {id(p) for p in model.parameters()}
    return sum(
        tensor_bytes(p) for g in optimizer.param_groups for p in g["params"] if id(p) not in own
    )


def state_dtype_of(optimizer: torch.optim.Optimizer) -> str:
    """The chosen state dtype, or fp32 / the dtype the state really has (model.half())."""
    chosen = getattr(optimizer, CHOSEN_STATE, None)
    if chosen is not None:
        return chosen
    floating = {dtype_name(v.dtype) for v in _state_tensors(optimizer) if v.is_floating_point()}
    return ",".join(sorted(floating)) or "fp32"
