"""What every amp_lab command shares: bad input as one line and exit code 2, the dated default
output folder, and results written as strict JSON."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from amp_lab.config import ConfigError


def error(message: str, tool: str = "amp_lab") -> int:
    """`tool: error: message` on stderr; the exit code of bad input."""
    print(f"{tool}: error: {message}", file=sys.stderr)
    return 2


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are `tool: error:` lines and which, given an `overrides`
    positional, takes Hydra overrides and options in any order, as `python -m amp_lab` does."""

    def __init__(self, tool: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tool = tool

    def error(self, message: str) -> NoReturn:
        sys.exit(error(f"{message} ({self.prog} --help)", self.tool))

    # typeshed overloads parse_args on the namespace's type; one signature serves every call
    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> Any:
        words = list(sys.argv[1:] if args is None else args)
        if "overrides" not in {action.dest for action in self._actions}:
            return super().parse_args(words, namespace)
        # a key=value word is an override wherever it stands, also after an option of several
        # values (--also bf16 model=test_convnext), unless it is a one-value option's value
        one_value = {flag for a in self._actions if a.nargs is None for flag in a.option_strings}
        picked = [
            "=" in word and not word.startswith("-") and (i == 0 or words[i - 1] not in one_value)
            for i, word in enumerate(words)
        ]
        parsed = self.parse_intermixed_args([w for w, p in zip(words, picked) if not p], namespace)
        parsed.overrides = [w for w, p in zip(words, picked) if p] + parsed.overrides
        return parsed


def parser(
    prog: str, description: str, tool: str = "amp_lab", **kwargs: Any
) -> argparse.ArgumentParser:
    """A tool's ArgumentParser: one-line errors; overrides and options in any order."""
    return _Parser(tool, prog=prog, description=description, **kwargs)


def dated(out: Path | None, root: str, stamp: str = "%Y-%m-%d/%H-%M-%S") -> Path:
    """`out`, or a new folder under `root` named after the date and time."""
    return out or Path(root) / datetime.now().strftime(stamp)


def strict_json(value: Any, nonfinite: Callable[[float], Any] = str) -> Any:
    """`value` with inf and nan replaced by `nonfinite(x)` (their string, or None): strict JSON
    readers (jq, JavaScript) reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return nonfinite(value)
    if isinstance(value, dict):
        return {k: strict_json(v, nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v, nonfinite) for v in value]
    return value


def run_tool(
    parse: Callable[[list[str]], argparse.Namespace],
    body: Callable[[argparse.Namespace], int],
    argv: list[str] | None,
) -> int:
    """Parse `argv` (default: the command line), log warnings plainly, run `body`; a ConfigError
    is one line and exit code 2."""
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        return body(args)
    except ConfigError as err:
        return error(str(err))
