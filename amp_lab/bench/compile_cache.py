"""Fill torch.compile's on-disk caches for the throughput table's compiled rows, in parallel.

A cold compile of a training step takes minutes (resnet50: about 100 s per precision on an H200);
inductor keeps what it builds on disk, keyed by graph, shapes, dtypes and settings. Compiling
every configuration once, in parallel processes, turns each timed row's compile into a cache
load. Each configuration's first step is recorded.

Each configuration compiles in its own `python -m amp_lab.bench.compile_cache` process, not in a
multiprocessing child: that one re-imports the main module as `__mp_main__`, which changed every
FX graph cache key, so no timed row found its graphs (measured: torch 2.14, test_vit, CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch

from amp_lab.bench.throughput import batch_stream, warm_up
from amp_lab.build import build
from amp_lab.components.metrics import synchronize
from amp_lab.compose import compose_settings
from amp_lab.config import AmpLabConfig, ConfigError


@dataclass
class CompileRecord:
    """One compiled configuration's first step, built from a cold or partly filled cache."""

    model: str
    precision: str
    first_step_s: float | None  # None when the process failed
    error: str | None = None


def first_steps(settings: AmpLabConfig, run_dir: Path, steps: int) -> float | None:
    """`steps` steps of the runner's compiled step, as the timed row's warm-up runs them (so
    every graph it needs gets built); returns the seconds of the first (None for no steps)."""
    run = build(settings, run_dir)
    first_step_s = warm_up(run, batch_stream(run), steps)
    synchronize(run.device)
    return first_step_s


def _compile_one(
    model: str,
    precision: str,
    overrides: list[str],
    run_dir: Path,
    process_args: list[str],
    compile_threads: int,
) -> CompileRecord:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "console.log"
    # an equal share of the cores for each process's kernel builds, not all of them each
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads)}
    with log.open("w") as stderr:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "amp_lab.bench.compile_cache",
                *process_args,
                "--run-dir",
                str(run_dir),
                "--",
                *overrides,
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            check=False,
        )
    if done.returncode == 0:  # its last line of output is the record
        seconds = json.loads(done.stdout.splitlines()[-1])["first_step_s"]
        return CompileRecord(model, precision, seconds)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return CompileRecord(
        model,
        precision,
        None,
        f"exit {done.returncode}: {lines[-1] if lines else 'no output'} ({log})",
    )


def fill_compile_caches(
    configs: list[tuple[str, str, list[str]]],
    run_root: Path,
    steps: int,
    jobs: int,
    torch_threads: int | None,
) -> Iterator[CompileRecord]:
    """Compile each (model, precision, overrides) in `jobs` processes at a time; yields each
    record as its process ends. `torch_threads` must be the timed process's: on a CPU, inductor
    writes the thread count into its kernels, so it is part of the cache key."""
    process_args = ["--steps", str(steps)]
    if torch_threads:
        process_args += ["--threads", str(torch_threads)]
    compile_threads = max(1, (os.cpu_count() or 1) // jobs)
    with ThreadPoolExecutor(jobs) as pool:  # each thread waits on one process
        futures = [
            pool.submit(
                _compile_one,
                model,
                precision,
                overrides,
                run_root / f"compile_{model}_{precision}",
                process_args,
                compile_threads,
            )
            for model, precision, overrides in configs
        ]
        for future in as_completed(futures):
            yield future.result()


def main() -> None:
    """One configuration, in the process `fill_compile_caches` starts for it."""
    parser = argparse.ArgumentParser(
        prog="python -m amp_lab.bench.compile_cache", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="the throughput row's config overrides")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        seconds = first_steps(compose_settings(args.overrides), args.run_dir, args.steps)
    except ConfigError as err:  # e.g. a device this machine lacks
        sys.exit(f"amp_lab.bench.compile_cache: error: {err}")
    print(json.dumps({"first_step_s": seconds}))


if __name__ == "__main__":
    main()
