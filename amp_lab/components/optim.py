"""Optimizers from timm's factory (fp32 state, fused kernels where they exist), or with the
low-precision state `optim.state_dtype` chooses (amp_lab/precision/optimizer_state.py)."""

from __future__ import annotations

import inspect

import torch
from timm.optim import (
    create_optimizer_v2,
    get_optimizer_class,
    list_optimizers,
    param_groups_weight_decay,
)

from amp_lab.config import ConfigError, OptimConfig
from amp_lab.precision.optimizer_state import build_state_optimizer

_SGD_NAMES = ("sgd", "momentum", "nesterov")


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """Decoupled weight decay on weights only (timm filters norms and biases out)."""
    if cfg.name not in list_optimizers():
        raise ConfigError(
            f"optim.name={cfg.name!r} is unknown; use adamw, sgd or one of timm's "
            f"{len(list_optimizers())} optimizers (timm.optim.list_optimizers())"
        )
    if cfg.state_dtype != "fp32":  # moments in 16 or fewer bits: optim.state_dtype's table
        # the groups timm's factory builds: no decay on norms, biases, the model's exclusions
        skip: set[str] = getattr(model, "no_weight_decay", set)()
        groups = param_groups_weight_decay(model, cfg.weight_decay, no_weight_decay_list=skip)
        return build_state_optimizer(groups, cfg, lr)
    kwargs = dict(cfg.kwargs)
    if cfg.name in _SGD_NAMES:
        kwargs.setdefault("nesterov", cfg.nesterov and cfg.momentum > 0)  # torch requires both
    # Fused optimizers take GradScaler's inf check on the device: no host sync per step.
    optimizer_cls = get_optimizer_class(cfg.name, bind_defaults=False)
    has_fused = "fused" in inspect.signature(optimizer_cls).parameters
    if cfg.fused and not has_fused:
        raise ConfigError(
            f"optim.fused=true but {cfg.name} has no fused kernel; use optim.fused=null"
        )
    if cfg.fused or (cfg.fused is None and has_fused):
        kwargs["fused"] = True
    return create_optimizer_v2(
        model,
        opt=cfg.name,
        lr=lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        filter_bias_and_bn=True,
        **kwargs,
    )
