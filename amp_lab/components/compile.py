"""torch.compile for a run (`trainer.compile`): the model, and in `step` mode the optimizer step.

`step` follows PyTorch's compiled-optimizer recipe: the plain per-tensor update for the compiler
to fuse, the LR a 0-d tensor so the schedule does not recompile. No CUDA graphs: the step's Python
(the scaler's decision, probe hooks) runs between them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch

from amp_lab.choices import CompileMode
from amp_lab.config import ConfigError, OptimConfig


def check_backend(backend: str) -> None:
    """Refuse a backend torch.compile does not know, before anything is compiled."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(
            f"trainer.compile_backend={backend} is not a torch.compile backend; use one of "
            f"{', '.join(sorted(known))}"
        )


def compile_model(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """The compiled module (an OptimizedModule; `_orig_mod` is the eager one)."""
    return cast(torch.nn.Module, torch.compile(model, backend=backend))


def optimizer_to_compile(cfg: OptimConfig, mode: str) -> OptimConfig:
    """The optimizer settings to build: in `step` mode its plain per-tensor update (a fused kernel
    in the graph is functionalised, copying every weight back: slower than the eager kernel)."""
    if mode != CompileMode.step:
        return cfg
    if cfg.fused:
        raise ConfigError(
            "trainer.compile=step compiles the optimizer's own update; optim.fused=true keeps "
            "its fused kernel instead: use optim.fused=null (or trainer.compile=model)"
        )
    return replace(cfg, fused=False, kwargs={**cfg.kwargs, "foreach": False})


def compile_optimizer_step(optimizer: torch.optim.Optimizer, backend: str) -> None:
    """Replace `optimizer.step` with a compiled one, each LR a tensor (after a checkpoint loads)."""
    kind = type(optimizer)
    if not kind.__module__.startswith("torch.optim"):
        raise ConfigError(
            f"trainer.compile=step compiles torch.optim's optimizers; {kind.__module__}."
            f"{kind.__name__} is not one: use trainer.compile=model, or optim=adamw / sgd"
        )
    for group in optimizer.param_groups:
        if not torch.is_tensor(group["lr"]):  # float LR: every schedule step would recompile
            group["lr"] = torch.tensor(float(group["lr"]))
    optimizer.step = torch.compile(optimizer.step, backend=backend)  # type: ignore[method-assign,assignment]
