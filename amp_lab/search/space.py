"""A search space from Hydra's override grammar, as hydra-optuna-sweeper reads it.

`hydra.sweeper.params` and the command line name the space: `interval(a, b)` is a float range,
`int(interval(a, b))` an int one, `tag(log, ...)` a log scale, `range(a, b[, step])` an int (or,
with a float bound or step, a float) range from a to b inclusive, and `choice(a, b)`, `a,b` or
`shuffle(...)` a categorical dimension (a group's options too: `precision=choice(fp16,bf16)`).
Each becomes an Optuna distribution, which `Study.ask` draws from; a plain value is fixed for
every trial. `study_per` keys are not searched: each of their values opens a study.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from hydra.core.override_parser.types import Override, Transformer
from hydra.errors import HydraException
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)


class SearchError(HydraException):
    """A bad search setting, told in one line (the `amp_lab` command exits 2)."""


class Space(NamedTuple):
    fixed: list[str]  # overrides every trial gets
    studies: list[list[str]]  # one override list per study (the study_per values)
    distributions: dict[str, BaseDistribution]  # searched: override key -> distribution


def distribution(override: Override) -> BaseDistribution:
    """The Optuna distribution of a sweep override."""
    value: Any = override.value()
    try:
        if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
            choices: list[Any] = list(override.sweep_iterator(Transformer.encode))  # primitives
            return CategoricalDistribution(choices)
        if override.is_range_sweep():
            ends = (value.start, value.stop, value.step)
            if any(isinstance(x, float) for x in ends):
                return FloatDistribution(value.start, value.stop, step=value.step)
            return IntDistribution(value.start, value.stop, step=value.step)
        if override.is_interval_sweep():
            log, ints = "log" in value.tags, isinstance(value.start, int)
            kind = IntDistribution if ints and isinstance(value.end, int) else FloatDistribution
            return kind(value.start, value.end, log=log)
    except ValueError as err:  # optuna's: low > high, a log scale from 0, ...
        raise SearchError(f"{override.input_line}: {err}") from None
    raise SearchError(f"{override.input_line}: a search draws from choice, range or interval")


def split(overrides: Iterable[Override], study_per: list[str]) -> Space:
    """The space of the overrides; of two overrides of one key the later wins (the command line
    over the config's params)."""
    last = {o.get_key_element(): o for o in overrides}
    fixed: list[str] = []
    studies: list[list[str]] = [[]]
    drawn: dict[str, BaseDistribution] = {}
    for key, override in last.items():
        if override.is_delete() or not override.is_sweep_override():
            fixed.append(override.input_line or f"{key}={override.get_value_element_as_str()}")
        elif override.key_or_group in study_per:
            if not override.is_discrete_sweep():
                raise SearchError(
                    f"{override.input_line}: a study_per key takes a list of values (a,b,c)"
                )
            studies = [
                [*s, f"{key}={v}"] for s in studies for v in override.sweep_string_iterator()
            ]
        else:
            drawn[key] = distribution(override)
    if not drawn:
        raise SearchError(
            "the search space is empty; name ranges in hydra.sweeper.params or on the command "
            "line, e.g. 'lr.base=tag(log, interval(1e-4, 1e-1))' (conf/search/lr.yaml)"
        )
    return Space(fixed, studies, drawn)
