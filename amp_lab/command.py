"""What every amp_lab command shares: bad input as one line and exit code 2, the dated default
output folder, and results written as strict JSON."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from amp_lab.config import ConfigError


def error(message: str, tool: str = "amp_lab") -> int:
    """`tool: error: message` on stderr; the exit code of bad input."""
    print(f"{tool}: error: {message}", file=sys.stderr)
    return 2


def parser(
    prog: str, description: str, tool: str = "amp_lab", **kwargs: Any
) -> argparse.ArgumentParser:
    """An ArgumentParser whose errors are `tool: error:` lines (argparse's usage block would be a
    second line)."""
    made = argparse.ArgumentParser(prog=prog, description=description, **kwargs)

    def one_line(message: str) -> NoReturn:
        sys.exit(error(f"{message} ({prog} --help)", tool))

    made.error = one_line  # type: ignore[method-assign]
    return made


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
