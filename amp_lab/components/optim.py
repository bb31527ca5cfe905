"""Optimizers from timm's factory, with fp32 state and fused kernels where they exist."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from timm.optim import create_optimizer_v2, get_optimizer_class, list_optimizers

from amp_lab.config import ConfigError, OptimConfig

_SGD_NAMES = ("sgd", "momentum", "nesterov")


def _wants_fused(cfg: OptimConfig, optimizer_cls: Callable[..., Any]) -> bool:
    # Fused optimizers take GradScaler's inf check on the device: no host sync per step.
    has_fused = "fused" in inspect.signature(optimizer_cls).parameters
    if cfg.fused and not has_fused:
        raise ConfigError(f"optim.fused=true but {cfg.name} has no fused kernel; "
                          "use optim.fused=null")
    return has_fused if cfg.fused is None else cfg.fused


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """Decoupled weight decay on weights only (timm filters norms and biases out)."""
    if cfg.name not in list_optimizers():
        raise ConfigError(f"optim.name={cfg.name!r} is unknown; use adamw, sgd or one of timm's "
                          f"{len(list_optimizers())} optimizers (timm.optim.list_optimizers())")
    kwargs = dict(cfg.kwargs)
    if cfg.name in _SGD_NAMES:
        kwargs.setdefault("nesterov", cfg.nesterov and cfg.momentum > 0)  # torch requires both
    if _wants_fused(cfg, get_optimizer_class(cfg.name, bind_defaults=False)):
        kwargs["fused"] = True
    return create_optimizer_v2(model, opt=cfg.name, lr=lr, weight_decay=cfg.weight_decay,
                               momentum=cfg.momentum, filter_bias_and_bn=True, **kwargs)
