"""A search space: schema settings and the range each is drawn from, checked before any trial.

`hydra.sweeper.space` nests like the settings it searches (`lr: {base: {low, high, log}}`), so
`hydra.sweeper.space.lr.base.high=0.3` works on the command line. Each setting becomes an Optuna
distribution, which `Study.ask` draws from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hydra.errors import HydraException
from optuna.distributions import BaseDistribution, FloatDistribution, IntDistribution

from amp_lab.errors import did_you_mean, schema_keys

RANGE_KEYS = {"low", "high", "log"}


class SearchError(HydraException):
    """A bad search setting, told in one line (the `amp_lab` command exits 2)."""


def override(key: str, value: float) -> str:
    """The override that sets a drawn value (an int distribution draws ints)."""
    # 4 significant digits keep job folder names short; no run tells 1e-4 relative LR apart
    return f"{key}={value}" if isinstance(value, int) else f"{key}={value:.4g}"


def _leaves(node: Mapping[str, Any], prefix: str = "") -> dict[str, Mapping[str, Any]]:
    """`{lr: {base: {low: ..}}}` -> `{"lr.base": {low: ..}}`: a mapping with a range key ends."""
    found: dict[str, Mapping[str, Any]] = {}
    for name, value in node.items():
        key = f"{prefix}{name}"
        if not isinstance(value, Mapping):
            raise SearchError(
                f"hydra.sweeper.space.{key}={value!r} is not a range; write "
                f"hydra.sweeper.space.{key}={{low: A, high: B}}"
            )
        if RANGE_KEYS & set(value):
            found[key] = value
        else:
            found.update(_leaves(value, f"{key}."))
    return found


def _distribution(key: str, spec: Mapping[str, Any]) -> BaseDistribution:
    where = f"hydra.sweeper.space.{key}"
    kind = schema_keys().get(key)
    if kind is None:
        raise SearchError(f"unknown search-space key {key}{did_you_mean(key)}")
    if kind not in ("int", "float"):
        raise SearchError(f"{key} is a {kind}, not a number: a search space draws int and float")
    if extra := set(spec) - RANGE_KEYS:
        raise SearchError(f"{where} has {', '.join(sorted(extra))}; a range has low, high, log")
    try:
        low, high, log = float(spec["low"]), float(spec["high"]), bool(spec.get("log", False))
    except (KeyError, TypeError, ValueError):
        raise SearchError(f"{where} needs numbers low and high (and log: true|false)") from None
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise SearchError(f"{where} is an empty range [{low:g}, {high:g}]; make low < high")
    if low < 0 or (log and low <= 0):
        scale = "a log-scale range needs low > 0" if log else "searched settings are >= 0"
        raise SearchError(f"{where}.low={low:g} is out of range: {scale}")
    if kind == "float":
        return FloatDistribution(low, high, log=log)
    if low != int(low) or high != int(high):
        raise SearchError(f"{where}: {key} is an int; give whole-number bounds")
    return IntDistribution(int(low), int(high), log=log)


def parse_space(space: Mapping[str, Any], fixed: set[str]) -> dict[str, BaseDistribution]:
    """The checked distributions of `space`, less the settings fixed on the command line."""
    found = {key: _distribution(key, spec) for key, spec in _leaves(space).items()}
    if not (drawn := {key: d for key, d in found.items() if key not in fixed}):
        raise SearchError(
            "the search space is empty; set hydra.sweeper.space (conf/search/lr.yaml)"
        )
    return drawn
