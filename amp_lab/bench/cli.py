"""`python -m amp_lab.bench`: the runner's overhead, and throughput per model x precision mode.

Every run is built from the real Hydra configs plus the options below; results go to
OUT/bench.json and OUT/bench.md, rewritten after every measurement so an interrupted benchmark
keeps what it measured. docs/benchmarks.md describes each part and its figures.

  python -m amp_lab.bench                                  # the defaults for this machine
  python -m amp_lab.bench --parts overhead --models test_vit --precisions fp32 bf16
  python -m amp_lab.bench --parts compile_cache throughput --compile on --jobs 8   # GPU
  python -m amp_lab.bench --parts peer --peer-script path/to/timm/train.py --models test_vit \
      --precisions bf16 --data-dir DIR --epochs 3 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from amp_lab.bench.compile_cache import CompileRecord, fill_compile_caches
from amp_lab.bench.feed import measure_feed
from amp_lab.bench.overhead import WARMUP_ROUNDS, OverheadResult, measure_overhead
from amp_lab.bench.peer import (
    PeerComparison,
    check_data_dir,
    check_peer_script,
    compare,
    peer_data,
)
from amp_lab.bench.record import environment, write_report
from amp_lab.bench.throughput import ThroughputRow, fill_speedups, measure_throughput, release
from amp_lab.build import build
from amp_lab.command import dated, error, parser
from amp_lab.components.distributed import resolve_device
from amp_lab.compose import compose_settings
from amp_lab.config import AmpLabConfig, ConfigError
from amp_lab.precision.modes import PRECISION_MODES, resolve_precision

# What an option not given means: (on a CPU, on a CUDA GPU)
DEFAULTS = {
    "models": (["test_vit", "test_convnext"], ["resnet50", "vit_base_patch16_224"]),
    "batch_size": (32, 128),
    "img_size": (32, 224),
    "compile": ("off", "both"),  # torch.compile on a small CPU costs minutes per model
    "workers": (0, 8),
}
Report = Callable[..., None]  # rewrites bench.json/bench.md with the results so far


def default_variants() -> list[str]:
    """Default telemetry, then each diagnostics mode (light, full) that the default is not."""
    default = compose_settings([]).diagnostics.mode
    return ["default"] + [f"diagnostics={name}" for name in ("light", "full") if name != default]


def variant_label(variant: str, settings: AmpLabConfig) -> str:
    """'default' names what the default telemetry is, e.g. 'default (diagnostics=light, W&B
    offline)', so a table read later says what was measured."""
    if variant != "default":
        return variant
    return f"default (diagnostics={settings.diagnostics.mode}, W&B {settings.logger.mode})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cli = parser(
        "python -m amp_lab.bench",
        __doc__.split("\n\n")[0],
        tool="amp_lab.bench",
        epilog="docs/benchmarks.md describes each part and its figures.",
    )
    add = cli.add_argument
    add(
        "--parts",
        nargs="+",
        choices=list(PARTS),
        default=["overhead", "throughput"],
        help="what to run, always in this order: compile_cache (fill torch.compile's caches "
        "for the compiled rows, --jobs processes at a time), overhead (amp_lab vs a bare loop), "
        "throughput, feed (synthetic vs JPEG files decoded on the host and on the device), "
        "peer (timm's train.py vs amp_lab); default: overhead throughput",
    )
    add("--models", nargs="+", help="conf/model presets (default: per device kind)")
    add(
        "--precisions",
        nargs="+",
        choices=list(PRECISION_MODES),
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
    add(
        "--rounds",
        type=int,
        default=5,
        help="timed overhead rounds after one warm-up round; peer: rounds of (peer, amp_lab)",
    )
    add(
        "--repeats",
        type=int,
        default=1,
        help="overhead: freshly built runs per row, rounds pooled (where a run's tensors land in "
        "memory moves its ratio by about 1.5%% on a CPU; default 1)",
    )
    add("--peer-script", type=Path, help="peer: timm's train.py, from a checkout of timm")
    add(
        "--data-dir",
        type=Path,
        help="feed, peer: an ImageFolder with train/ and val/ (default: synthetic JPEGs)",
    )
    add("--epochs", type=int, default=3, help="peer: epochs of each run (default 3)")
    add("--workers", type=int, help="feed, peer: loader workers (default: 0 on CPU, 8 on CUDA)")
    add("--compile", choices=["off", "on", "both"], help="throughput (default: off on CPU, both)")
    add("--jobs", type=int, default=1, help="compile_cache processes at a time (default 1)")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add("--threads", type=int, help="torch CPU threads (default: the CPUs this process has)")
    add("--override", nargs="+", default=[], metavar="KEY=VALUE", help="for every run")
    add("--out", type=Path, help="output folder (default: outputs/bench/DATE_TIME)")
    args = cli.parse_args(argv)
    if min(args.steps, args.rounds, args.repeats, args.jobs, args.epochs) < 1 or args.warmup < 0:
        cli.error("--steps, --rounds, --repeats, --jobs and --epochs must be >= 1, --warmup >= 0")
    return args


def runnable_precisions(device: torch.device) -> list[str]:
    """Every mode in PRECISION_MODES that this device can run, in table order."""
    names = []
    for name in PRECISION_MODES:
        with contextlib.suppress(ConfigError):  # a mode this device cannot run
            resolve_precision(name, device)
            names.append(name)
    return names


def _common(args: argparse.Namespace, model: str, precision: str, *extra: str) -> list[str]:
    """Every run's overrides; the user's --override come last, so they win."""
    return [
        f"model={model}",
        f"precision={precision}",
        f"data.img_size={args.img_size}",
        f"trainer.batch_size={args.batch_size}",
        f"trainer.device={args.device}",
        f"trainer.threads={args.threads or 0}",  # 0: the CPUs the process was given
        "trainer.progress=false",
        "trainer.resume=false",  # every run starts afresh, also in an --out used before
        *extra,
        *args.override,
    ]


def _overrides(args: argparse.Namespace, model: str, precision: str, *extra: str) -> list[str]:
    # 10 batches of synthetic samples (8 for training): distinct batches, little device memory
    return _common(
        args,
        model,
        precision,
        "data=synthetic",
        f"data.num_samples={10 * args.batch_size}",
        "data.num_classes=1000",
        "checkpoint.enabled=false",
        *extra,
    )


def run_overhead(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """The amp_lab loop against the bare loop, per model, variant and precision."""
    results: list[OverheadResult] = []
    total = (WARMUP_ROUNDS + args.rounds) * args.steps
    # evaluation only after the end; a constant LR, as the bare loop has (the schedule still
    # steps every step), so both loops take the same optimizer steps
    timing = [
        f"trainer.max_steps={total}",
        f"trainer.eval_every={total + 1}",
        "lr.schedule=constant",
    ]
    for model, variant, precision in itertools.product(args.models, args.variants, args.precisions):
        if getattr(PRECISION_MODES[precision], "param_dtype", torch.float32) != torch.float32:
            print(
                f"overhead {model} {variant} {precision}: skipped, the bare recipe (autocast over "
                "fp32 weights) has no pure 16-bit weights",
                file=sys.stderr,
            )
            continue
        extra = [] if variant == "default" else variant.split()
        settings = compose_settings(_overrides(args, model, precision, *timing, *extra))
        if args.steps % settings.trainer.log_every:
            every = settings.trainer.log_every
            raise ConfigError(
                f"--steps {args.steps} must be a multiple of "
                f"trainer.log_every={every}; use --steps {every} (or a "
                f"multiple), or add --override trainer.log_every={args.steps}"
            )
        row = args.out / "runs" / f"overhead_{model}_{variant.replace(' ', '_')}_{precision}"
        run_dirs = [row.with_name(f"{row.name}_run{i}") for i in range(2, args.repeats + 1)]
        label = variant_label(variant, settings)
        result = measure_overhead(settings, [row, *run_dirs], args.steps, label)
        results.append(result)
        runs = ", ".join(f"{m:.3f}" for m in result.run_medians)
        print(
            f"overhead {model} {result.variant} {precision}: median ratio "
            f"{result.median_ratio:.3f}" + (f" (runs: {runs})" if args.repeats > 1 else ""),
            file=sys.stderr,
        )
        report(overhead=results)


def throughput_overrides(
    args: argparse.Namespace, model: str, precision: str, compiled: bool
) -> list[str]:
    """One throughput row's config; compile_cache compiles exactly these, so the caches hit."""
    return _overrides(
        args,
        model,
        precision,
        f"trainer.compile={str(compiled).lower()}",
        f"trainer.max_steps={args.warmup + 2 * args.steps}",
    )


def run_compile_cache(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """Every compiled throughput row's configuration built once, --jobs processes at a time,
    precision by precision: a mode whose kernels an earlier one shares (tf32 compiles the same
    graph as fp32) starts after it, and loads what it finds built."""
    configs = [
        (model, precision, throughput_overrides(args, model, precision, True))
        for precision in args.precisions
        for model in args.models
    ]
    records: list[CompileRecord] = []
    for record in fill_compile_caches(args, configs):
        records.append(record)
        report(compile_cache=records)
        outcome = record.error or f"first step {record.first_step_s:.1f} s"
        print(f"compile_cache {record.model} {record.precision}: {outcome}", file=sys.stderr)


def run_throughput(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """One row per model x compile setting x precision; a failing row is recorded, not fatal."""
    rows: list[ThroughputRow] = []
    errors: list[dict[str, Any]] = []
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    flops: dict[str, int] = {}  # per model: counted once, the same in every precision
    for model, compiled, precision in itertools.product(args.models, compiles, args.precisions):
        settings = compose_settings(throughput_overrides(args, model, precision, compiled))
        run = build(settings, args.out / "runs" / "throughput")
        try:
            rows.append(measure_throughput(run, args.warmup, args.steps, flops.get(model)))
            flops[model] = rows[-1].flops_per_step
            outcome = f"{rows[-1].samples_per_s:.1f} samples/s"
        except (RuntimeError, torch.OutOfMemoryError) as err:  # OOM, compile failure
            outcome = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            errors.append(dict(model=model, precision=precision, compile=compiled, error=outcome))
        del run
        release(device, compiled)
        fill_speedups(rows)
        report(throughput=rows, throughput_errors=errors)
        print(f"throughput {model} {precision} compile={compiled}: {outcome}", file=sys.stderr)


def run_feed(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """Synthetic vs JPEG files decoded on the host vs on the device: --models[0] x
    --precisions[0], --warmup + --steps steps each."""
    root = peer_data(args)
    steps = args.warmup + args.steps
    base = _common(
        args,
        args.models[0],
        args.precisions[0],
        f"data.num_workers={args.workers}",
        f"trainer.max_steps={steps}",
        f"trainer.timing_warmup={args.warmup}",
        f"trainer.eval_every={steps + 1}",  # one evaluation, after the last step
        "checkpoint.enabled=false",
    )
    rows = measure_feed(base, root, device, args.out, args.batch_size)
    report(feed=rows)
    for row in rows:
        print(
            f"feed {row.data}: {row.samples_per_s:.1f} samples/s, data share "
            f"{row.data_share if row.data_share is not None else float('nan'):.2f}",
            file=sys.stderr,
        )


def run_peer(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """Each model x precision: the peer and amp_lab, alternated for --rounds rounds."""
    root = peer_data(args)
    done: list[PeerComparison] = []
    for model, precision in itertools.product(args.models, args.peer_precisions):
        overrides = _common(  # whole runs, as a user runs them
            args,
            model,
            precision,
            "data=imagefolder",
            f"data.root={root}",
            f"data.num_workers={args.workers}",
            f"trainer.epochs={args.epochs}",
        )
        for comparison in compare(args, overrides, root):
            report(peer=[*done, comparison])
        done.append(comparison)
        amp_lab, peer = (comparison.median(p, "samples_per_s") for p in ("amp_lab", "peer"))
        print(
            f"peer {model} {precision}: amp_lab {amp_lab:.1f} vs peer {peer:.1f} samples/s "
            f"({comparison.ratio:.3f}x)",
            file=sys.stderr,
        )


PARTS = {  # the order they run in
    "compile_cache": run_compile_cache,
    "overhead": run_overhead,
    "throughput": run_throughput,
    "feed": run_feed,
    "peer": run_peer,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA GPU is visible; use --device cpu")
        device = resolve_device(args.device)
        for key, (cpu, cuda) in DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, cuda if device.type == "cuda" else cpu)
        args.peer_precisions = args.precisions or ["bf16"]  # a mode timm's train.py has
        args.precisions = args.precisions or runnable_precisions(device)
        args.variants = args.variants or default_variants()
        args.out = dated(args.out, "outputs/bench", "%Y-%m-%d_%H-%M-%S")
        for model in args.models:  # a bad model or mode fails now, not after minutes of rows
            for precision in args.precisions:
                compose_settings(_overrides(args, model, precision))
        if "peer" in args.parts:  # a bad file fails now, not after the other parts
            args.peer_script = check_peer_script(args.peer_script)
        if args.data_dir is not None and {"feed", "peer"} & set(args.parts):
            args.data_dir = check_data_dir(args.data_dir)
        env = environment(device, sys.argv[1:] if argv is None else argv)
        results: dict[str, list[Any]] = {}  # each part's, so far

        def report(**update: list[Any]) -> None:
            results.update(update)
            write_report(args.out, env, results)

        for name, run_part in PARTS.items():
            if name in args.parts:
                run_part(args, device, report)
    except ConfigError as err:
        return error(str(err), "amp_lab.bench")
    print((args.out / "bench.md").read_text(encoding="utf-8"))
    print(f"written: {args.out / 'bench.json'}, {args.out / 'bench.md'}", file=sys.stderr)
    return 0
