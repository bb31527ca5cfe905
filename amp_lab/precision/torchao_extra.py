"""torchao, the optional extra behind float8 layers and low-bit optimizer states, imported once
and quietly."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from amp_lab.config import ConfigError


def import_torchao(module: str, needed_for: str, extra: str) -> ModuleType:
    """`module` of torchao, or a ConfigError naming the setting and the extra to install."""
    # torchao's import logs a pytree deprecation on every run, which the user cannot act on
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"{needed_for} needs torchao ({err}): pip install '{extra}'") from err
    finally:
        pytree_log.setLevel(level)
