"""`precision.fp32_modules`: run chosen modules in fp32 inside an autocast forward.

A module matching a pattern (`*norm*`, `head`) gets fp32 inputs and autocast disabled, so its ops
and their gradients stay in fp32 (docs/amp_pitfalls.md §4).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from collections.abc import Callable
from typing import Any

import torch

from amp_lab.config import ConfigError


def _to_fp32(value: Any) -> Any:
    if torch.is_tensor(value) and value.is_floating_point():
        return value.float()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_fp32(v) for v in value)
    return value


def _fp32_forward(forward: Callable, device_type: str) -> Callable:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            return forward(*_to_fp32(args), **{k: _to_fp32(v) for k, v in kwargs.items()})

    return wrapped


def within(module: str, names: list[str]) -> bool:
    """`module` is one of `names` or inside one of them ('' names the root, which holds all)."""
    return any(name == "" or module == name or module.startswith(f"{name}.") for name in names)


def matching_modules(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Qualified names of the modules matching any pattern; a pattern matching none is an error."""
    names = [name for name, _ in model.named_modules() if name]
    matched: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"precision.fp32_modules: {pattern!r} matches no module of the "
                f"model{hint} (names as in model.named_modules())"
            )
        matched += [n for n in hits if n not in matched]
    return matched


def keep_in_fp32(model: torch.nn.Module, patterns: list[str], device: torch.device) -> list[str]:
    """Wrap the matching modules' forward in an fp32, autocast-disabled region; returns names."""
    names = matching_modules(model, patterns)
    for name in names:
        module = model.get_submodule(name)
        module.forward = _fp32_forward(module.forward, device.type)
    return names
