"""`python -m amp_lab bench`: the runner's overhead, and throughput per model x precision mode.

Runs are built from the real Hydra configs plus the options below; OUT/bench.json and bench.md
are rewritten after every measurement, so an interrupted benchmark keeps what it measured. A
checkout's `python -m benchmarks.bench` adds the parts that need the repository (compile_cache,
feed, peer). docs/benchmarks.md describes each part and its figures.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amp_lab.choices import PrecisionName
from amp_lab.command import dated, error, parser

if TYPE_CHECKING:
    import torch

# What an option not given means: (on a CPU, on a CUDA GPU)
DEFAULTS = {
    "models": (["test_vit", "test_convnext"], ["resnet50", "vit_base_patch16_224"]),
    "batch_size": (32, 128),
    "img_size": (32, 224),
    "compile": ("off", "both"),  # torch.compile on a small CPU costs minutes per model
}

# The parts, in the order they run: name -> its module, whose `part(args, device, report)` runs
# it and whose `section(results)` writes its table into bench.md
PARTS = {"overhead": "amp_lab.tools.bench.overhead", "throughput": "amp_lab.tools.bench.throughput"}
DEFAULT_PARTS = ["overhead", "throughput"]
# more options and their checks (after this device's defaults are in), for more parts
Extension = tuple[
    Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace, "torch.device"], None]
]


def default_variants() -> list[str]:
    """Default telemetry, then each diagnostics mode (light, full) that the default is not."""
    from amp_lab.compose import compose_settings

    default = compose_settings([]).diagnostics.mode
    return ["default"] + [f"diagnostics={name}" for name in ("light", "full") if name != default]


def parse_args(
    argv: list[str] | None,
    parts: dict[str, str] = PARTS,
    prog: str = "python -m amp_lab bench",
    more: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    cli = parser(
        prog,
        __doc__.split("\n\n")[0],
        tool="amp_lab bench",
        epilog="docs/benchmarks.md describes each part and its figures.",
    )
    add = cli.add_argument
    add(
        "--parts",
        nargs="+",
        choices=list(parts),
        default=DEFAULT_PARTS,
        help=f"what to run, always in this order: {', '.join(parts)} (overhead: amp_lab vs a "
        "bare loop; docs/benchmarks.md says what each measures); default: overhead throughput",
    )
    add("--models", nargs="+", help="conf/model presets (default: per device kind)")
    add(
        "--precisions",
        nargs="+",
        choices=[p.value for p in PrecisionName],
        help="precision modes (default: all this device runs)",
    )
    add(
        "--variants",
        nargs="+",
        help="overhead: 'default' or config overrides, e.g. 'diagnostics=off' (default: default "
        "and each diagnostics mode the default is not)",
    )
    add("--batch-size", type=int, help="per step (default: 32 on CPU, 128 on CUDA)")
    add("--img-size", type=int, help="image size (default: 32 on CPU, 224 on CUDA)")
    add(
        "--steps",
        type=int,
        default=20,
        help="timed steps per throughput row and overhead round (a multiple of "
        "trainer.log_every; default 20)",
    )
    add("--warmup", type=int, default=5, help="throughput warm-up steps (default 5)")
    add("--rounds", type=int, default=5, help="timed overhead rounds after a warm-up round")
    add(
        "--repeats",
        type=int,
        default=1,
        help="overhead: freshly built runs per row, rounds pooled (where a run's tensors land in "
        "memory moves its ratio by about 1.5%% on a CPU; default 1)",
    )
    add("--compile", choices=["off", "on", "both"], help="throughput (default: off on CPU, both)")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add("--threads", type=int, help="torch CPU threads (default: the CPUs this process has)")
    add("--override", nargs="+", default=[], metavar="KEY=VALUE", help="for every run")
    add("--out", type=Path, help="output folder (default: outputs/bench/DATE_TIME)")
    if more is not None:
        more(cli)
    args = cli.parse_args(argv)
    if min(args.steps, args.rounds, args.repeats) < 1 or args.warmup < 0:
        cli.error("--steps, --rounds and --repeats must be >= 1, --warmup >= 0")
    return args


def runnable_precisions(device: torch.device) -> list[str]:
    """Every mode in PRECISION_MODES that this device can run, in table order."""
    from amp_lab.config import ConfigError
    from amp_lab.precision.modes import PRECISION_MODES, resolve_precision

    names = []
    for name in PRECISION_MODES:
        with contextlib.suppress(ConfigError):  # a mode this device cannot run
            resolve_precision(name, device)
            names.append(name)
    return names


def main(
    argv: list[str] | None = None,
    parts: dict[str, str] = PARTS,
    prog: str = "python -m amp_lab bench",
    extension: Extension | None = None,
) -> int:
    """Parse, fill in this device's defaults, check every input, then run the parts in order."""
    more, check = extension or (None, None)
    args = parse_args(argv, parts, prog, more)  # before torch loads: --help answers at once
    import torch

    from amp_lab.components.distributed import resolve_device
    from amp_lab.compose import compose_settings
    from amp_lab.config import ConfigError
    from amp_lab.tools.bench.record import environment, write_report
    from amp_lab.tools.bench.runs import throughput_overrides

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA GPU is visible; use --device cpu")
        device = resolve_device(args.device)
        for key, (cpu, cuda) in DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, cuda if device.type == "cuda" else cpu)
        if check is not None:
            check(args, device)
        args.precisions = args.precisions or runnable_precisions(device)
        args.variants = args.variants or default_variants()
        args.out = dated(args.out, "outputs/bench", "%Y-%m-%d_%H-%M-%S")
        for model in args.models:  # a bad model or mode fails now, not after minutes of rows
            for precision in args.precisions:
                compose_settings(throughput_overrides(args, model, precision, False))
        env = environment(device, prog, sys.argv[1:] if argv is None else argv)
        modules = [importlib.import_module(parts[name]) for name in parts if name in args.parts]
        results: dict[str, list[Any]] = {}  # each part's, so far

        def report(**update: list[Any]) -> None:
            results.update(update)
            write_report(args.out, env, results, modules)

        for module in modules:
            module.part(args, device, report)
    except ConfigError as err:
        return error(str(err), "amp_lab bench")
    print((args.out / "bench.md").read_text(encoding="utf-8"))
    print(f"written: {args.out / 'bench.json'}, {args.out / 'bench.md'}", file=sys.stderr)
    return 0
