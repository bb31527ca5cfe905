"""Any timm model by name, shaped to the data, never downloading weights."""

from __future__ import annotations

import copy
import difflib
from typing import Any

import timm
import torch

from amp_lab.components.data import DataSpec
from amp_lab.config import ConfigError, ModelConfig


def create_sized(name: str, img_size: int, **kwargs: Any) -> tuple[torch.nn.Module, bool]:
    """timm.create_model(pretrained=False), with img_size if the model takes it; whether it did."""
    try:  # transformers need the image size; CNNs take any size and reject the argument
        return timm.create_model(name, pretrained=False, img_size=img_size, **kwargs), True
    except TypeError as err:
        if "img_size" not in str(err):
            raise ConfigError(f"model.kwargs do not fit {name}: {err}") from err
    try:
        return timm.create_model(name, pretrained=False, **kwargs), False
    except TypeError as err:
        raise ConfigError(f"model.kwargs do not fit {name}: {err}") from err


def build_model(cfg: ModelConfig, spec: DataSpec) -> torch.nn.Module:
    """timm.create_model(pretrained=False) with channels, classes and image size from the data."""
    if not timm.is_model(cfg.name):
        close = difflib.get_close_matches(cfg.name, timm.list_models(), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models()"
        raise ConfigError(f"model.name={cfg.name!r} is not a timm model{hint}")
    rates = {"drop_path_rate": cfg.drop_path_rate, "drop_rate": cfg.drop_rate}  # timm's meaning
    kwargs: dict[str, Any] = {"num_classes": spec.num_classes, "in_chans": spec.channels}
    kwargs |= {k: v for k, v in rates.items() if v > 0}
    kwargs |= cfg.kwargs
    model, _ = create_sized(cfg.name, spec.img_size, **kwargs)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def place(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model on `device`, its tensors in fresh memory in module order: on a CPU a copy, as
    test_convnext's step ran ~3% slower amid timm's freed temporaries (docs/benchmarks.md)."""
    if device.type != "cpu":
        return model.to(device)
    return copy.deepcopy(model)


@torch.no_grad()
def check_input_fits(
    model: torch.nn.Module, name: str, spec: DataSpec, device: torch.device
) -> None:
    """One tiny forward pass in the weights' dtype, so a size mismatch fails before training."""
    model.eval()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    try:
        model(
            torch.zeros(2, spec.channels, spec.img_size, spec.img_size, device=device, dtype=dtype)
        )
    except (RuntimeError, AssertionError) as err:  # timm's patch embedding asserts its sizes
        reason = str(err).splitlines()[0]
        raise ConfigError(
            f"model {name} cannot take {spec.channels}x{spec.img_size}x"
            f"{spec.img_size} images ({reason}); raise data.img_size or pick "
            f"another model"
        ) from err
    finally:
        model.train()
