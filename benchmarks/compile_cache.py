"""`--parts compile_cache`: fill torch.compile's on-disk caches for the compiled rows, in parallel.

A cold compile of a training step takes minutes (resnet50: about 100 s per precision on an H200);
inductor keeps what it builds on disk, keyed by graph, shapes, dtypes and settings. Compiling
every configuration once, in parallel processes, turns each timed row's compile into a cache
load. Each configuration's first step is recorded.

Each configuration compiles in its own `python -m benchmarks.compile_cache` process,
not in a multiprocessing child: that one re-imports the main module as `__mp_main__`, which
changed every FX graph cache key, so no timed row found its graphs (measured: torch 2.14,
test_vit, CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from amp_lab.config import ConfigError
from amp_lab.tools import probe
from amp_lab.tools.bench import record
from amp_lab.tools.bench.runs import Report, throughput_overrides
from amp_lab.tools.bench.throughput import batch_stream, warm_up

ROOT = Path(__file__).resolve().parents[1]
RECORD = "first_step.json"  # the record a compile process leaves in its run folder


@dataclass
class CompileRecord:
    """One compiled configuration's first step, built from a cold or partly filled cache."""

    model: str
    precision: str
    first_step_s: float | None  # None when the process failed
    error: str | None = None


def run_logged(command: list[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> int:
    """Run `command` with its output (stdout and stderr) in `log`; its exit code."""
    with log.open("w") as out:
        done = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return done.returncode


def last_line(log: Path) -> str:
    """The last line of output in `log`: what a failed process said last."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def part(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """Every compiled throughput row's configuration built once, --jobs processes at a time,
    --warmup steps (at least one) each, precision by precision: a mode whose kernels an earlier
    one shares (tf32 compiles the same graph as fp32) starts after it, and loads what it finds
    built. --threads is passed on: on a CPU, inductor writes the thread count into its kernels,
    so it is part of the cache key."""
    steps = ["--steps", str(max(1, args.warmup))]
    threads = ["--threads", str(args.threads)] if args.threads else []
    # an equal share of the cores for each process's kernel builds, not all of them each
    compile_threads = max(1, (os.cpu_count() or 1) // args.jobs)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads)}
    # `python -m benchmarks.compile_cache` from the checkout, whatever the current folder
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    def compile_one(model: str, precision: str) -> CompileRecord:
        run_dir = args.out / "runs" / f"compile_{model}_{precision}"
        run_dir.mkdir(parents=True, exist_ok=True)
        log, overrides = run_dir / "console.log", throughput_overrides(args, model, precision, True)
        command = [
            sys.executable,
            "-m",
            "benchmarks.compile_cache",
            "--run-dir",
            str(run_dir),
        ]
        code = run_logged([*command, *steps, *threads, "--", *overrides], log, env)
        if code:
            return CompileRecord(model, precision, None, f"exit {code}: {last_line(log)} ({log})")
        seconds = json.loads((run_dir / RECORD).read_text())["first_step_s"]
        return CompileRecord(model, precision, seconds)

    records: list[CompileRecord] = []
    with ThreadPoolExecutor(args.jobs) as pool:  # each thread waits on one process
        futures = [pool.submit(compile_one, m, p) for p in args.precisions for m in args.models]
        for future in as_completed(futures):
            records.append(record := future.result())
            report(compile_cache=records)
            outcome = record.error or f"first step {record.first_step_s:.1f} s"
            print(f"compile_cache {record.model} {record.precision}: {outcome}", file=sys.stderr)


def main() -> None:
    """One configuration, in the process `part` starts for it."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compile_cache", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="the throughput row's config overrides")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # the steps as the timed row's warm-up runs them, so every graph it needs gets built
        run = probe.build_run(probe.settings(args.overrides, quiet=False), args.run_dir)
        seconds = warm_up(run, batch_stream(run), args.steps)
    except ConfigError as err:  # e.g. a device this machine lacks
        sys.exit(f"benchmarks.compile_cache: error: {err}")
    (args.run_dir / RECORD).write_text(json.dumps({"first_step_s": seconds}))


def section(results: dict[str, list[Any]]) -> list[str]:
    records: list[CompileRecord] = results.get("compile_cache", [])
    rows = [
        [
            r.model,
            r.precision,
            f"{r.first_step_s:.1f}" if r.first_step_s is not None else f"failed: {r.error}",
        ]
        for r in records
    ]
    return record.section(
        "torch.compile caches filled (each configuration's first step, with compilation, run in "
        "parallel processes)",
        "model | precision | first step s",
        rows,
    )


if __name__ == "__main__":
    main()
