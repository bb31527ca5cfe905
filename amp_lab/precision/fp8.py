"""float8 training of Linear layers with torchao (an optional extra: `pip install amp-lab[fp8]`).

Eligible `nn.Linear` layers become torchao's `Float8Linear`, the rest runs in bf16 autocast, the
weights and optimizer stay fp32. Emulation (no SM 8.9+) is a slow correctness check only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from amp_lab.config import ConfigError
from amp_lab.precision.fp32_modules import within
from amp_lab.precision.torchao_extra import import_torchao


def _torchao_float8() -> Any:
    return import_torchao("torchao.float8", "precision=fp8", "amp-lab[fp8]")


def check_fp8_device(device: torch.device, emulate: bool) -> None:
    """Hardware float8 matmuls need SM 8.9+; emulation runs anywhere."""
    _torchao_float8()
    if emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"precision=fp8 needs an NVIDIA GPU with SM 8.9+ (not {device.type}); "
            "set precision.fp8_emulate=true to check correctness without one"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"precision=fp8 needs SM 8.9+ (Ada/Hopper), this GPU is SM "
            f"{major}.{minor}; use bf16, or precision.fp8_emulate=true"
        )


def fp8_skip_reason(
    module: torch.nn.Linear, fqn: str, head: torch.nn.Module | None, fp32_modules: list[str]
) -> str | None:
    """Why the fp8 filter leaves this Linear in bf16, or None when it converts it."""
    if module is head:  # its output feeds the loss directly and is small: float8 buys nothing
        return "the classifier"
    if within(fqn, fp32_modules):
        return "in precision.fp32_modules"
    # float8 GEMMs (torch._scaled_mm) need both matrix dims divisible by 16
    if module.in_features % 16 or module.out_features % 16:
        return f"dims {module.in_features}x{module.out_features} not multiples of 16"
    return None


def classifier(model: torch.nn.Module) -> torch.nn.Module | None:
    """timm's classifier head (get_classifier()), or None for a model without one."""
    get_classifier = getattr(model, "get_classifier", None)
    return get_classifier() if callable(get_classifier) else None


def convert_to_fp8(
    model: torch.nn.Module, recipe: str, emulate: bool, fp32_modules: list[str]
) -> None:
    """Swap eligible Linear layers for Float8Linear in place."""
    float8 = _torchao_float8()
    from torchao.float8.float8_linear import Float8Linear

    # torchao's own recipe Enum: it takes a plain str or its Enum, not the schema's str Enum
    recipe_name = float8.Float8LinearRecipeName(str(recipe))
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(recipe_name), emulate=emulate
    )
    head = classifier(model)

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, torch.nn.Linear)
            and fp8_skip_reason(module, fqn, head, fp32_modules) is None
        )

    float8.convert_to_float8_training(model, module_filter_fn=keep, config=config)
    if not any(isinstance(m, Float8Linear) for m in model.modules()):
        raise ConfigError(
            "precision=fp8 converted no Linear layer of this model (each is its classifier, in "
            "precision.fp32_modules, or of dims not multiples of 16); use bf16 for it"
        )
