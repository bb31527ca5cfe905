"""`--parts throughput`: per configuration, samples/s, the step split into phases, memory, MFU,
measured as timm's benchmark.py does: warm-up left out, the device synchronised only at the
timing boundaries of real `TrainStep` calls (for the split, of extra steps as stages return)."""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from amp_lab.choices import CompileMode
from amp_lab.components.metrics import peak_memory_mb, reset_peak_memory, synchronize
from amp_lab.precision.optimizer_state import master_weight_bytes, state_bytes
from amp_lab.run import Run
from amp_lab.step import Batch, take
from amp_lab.tools import probe
from amp_lab.tools.bench import record
from amp_lab.tools.bench.flops import TFLOPS, mfu, peak_flops, train_step_flops
from amp_lab.tools.bench.runs import Report, throughput_overrides


@dataclass
class ThroughputRow:
    """One model x precision x compile configuration."""

    model: str
    precision: str
    compile: bool
    channels_last: bool
    batch_size: int  # global batch per optimizer step
    img_size: int
    first_step_s: float | None  # the first warm-up step: compilation, autotuning, allocation
    samples_per_s: float
    step_ms: float  # unsynchronised real steps
    forward_ms: float  # forward + loss, from the phase-synchronised steps
    backward_ms: float
    optimizer_ms: float  # unscale, grad norm, clip, optimizer step, scaler update, schedule,
    # diagnostics (and zero_grad, accuracy counting)
    peak_memory_mb: float  # in the timed steps: CUDA peak allocated; CPU peak RSS (Linux)
    flops_per_step: int  # forward + backward, counted by torch.utils.flop_counter
    achieved_tflops: float
    mfu: float | None  # None on a CPU or a GPU missing from amp_lab.flops.PEAK_TFLOPS
    state_dtype: str  # optim.state_dtype
    state_mb: float  # optimizer state + fp32 master weights, from the tensors' sizes
    fp8_linears: int = 0  # nn.Linear layers torchao converted to Float8Linear
    fp8_recipe: str | None = None  # precision.fp8_recipe of an fp8 row
    speedup_vs_fp32: float | None = None  # filled in once the fp32 row of the same group exists


def batch_stream(run: Run) -> Iterator[list[Batch]]:
    """Micro-batches for one optimizer step at a time, from the runner's own data, endlessly."""
    epoch = 0
    while True:
        run.sampler.set_epoch(epoch)
        batches = run.data.train_batches(run.sampler)
        for _ in range(run.steps_per_epoch):
            yield take(batches, run.settings.trainer.grad_accum)
        epoch += 1


# the stage whose end closes each timed phase; the rest of the step is the optimizer phase
PHASE_END = {"forward_and_loss": 0, "backward": 1}


def phase_times(run: Run, stream: Iterator[list[Batch]], steps: int) -> list[float]:
    """Mean seconds of the forward, backward and optimizer phases over `steps` real steps."""
    device = run.device
    totals = [0.0, 0.0, 0.0]
    mark = 0.0

    def stage_done(stage: str) -> None:
        nonlocal mark
        if stage in PHASE_END:
            synchronize(device)
            now = time.perf_counter()
            totals[PHASE_END[stage]] += now - mark
            mark = now

    with run.train_step.watching_stages(stage_done):
        for _ in range(steps):
            micro_batches = next(stream)
            synchronize(device)
            mark = time.perf_counter()
            run.train_step(micro_batches)
            synchronize(device)
            totals[2] += time.perf_counter() - mark
    return [total / steps for total in totals]


def timed_steps(run: Run, stream: Iterator[list[Batch]], steps: int) -> float:
    """Seconds of `steps` real steps, the device synchronised only before and after them."""
    synchronize(run.device)
    start = time.perf_counter()
    for _ in range(steps):
        run.train_step(next(stream))
    synchronize(run.device)
    return time.perf_counter() - start


def warm_up(run: Run, stream: Iterator[list[Batch]], steps: int) -> float | None:
    """`steps` steps as the timed ones run them; the seconds of the first (compilation,
    autotuning, allocator growth), or None without warm-up."""
    if steps < 1:
        return None
    first_step_s = timed_steps(run, stream, 1)
    timed_steps(run, stream, steps - 1)
    return first_step_s


def measure_throughput(
    run: Run, warmup: int, steps: int, flops: int | None = None
) -> ThroughputRow:
    """Warm up, time `steps` real steps, then the phase split, peak memory and (unless given,
    as they do not depend on the precision) the FLOPs of a step."""
    stream = batch_stream(run)
    first_step_s = warm_up(run, stream, warmup)
    reset_peak_memory(run.device)
    step_s = timed_steps(run, stream, steps) / steps
    forward_s, backward_s, optimizer_s = phase_times(run, stream, max(2, steps // 4))
    memory = peak_memory_mb(run.device)
    if flops is None:
        images, labels = next(stream)[0]
        flops = train_step_flops(run.model, images, labels, run.policy.autocast())
        flops *= run.settings.trainer.grad_accum
    s, mode = run.settings, run.policy.mode
    # a mode may declare its peak ill-defined (e.g. fp8 matmuls mixed with bf16 ones)
    peak = peak_flops(run.device, mode.matmul_dtype) if mode.reports_mfu else None
    return ThroughputRow(
        model=s.model.name,
        precision=mode.name,
        compile=s.trainer.compile != CompileMode.off,
        channels_last=s.model.channels_last,
        batch_size=run.global_batch,
        img_size=s.data.img_size,
        first_step_s=first_step_s,
        samples_per_s=run.global_batch / step_s,
        step_ms=1000 * step_s,
        forward_ms=1000 * forward_s,
        backward_ms=1000 * backward_s,
        optimizer_ms=1000 * optimizer_s,
        peak_memory_mb=memory,
        flops_per_step=flops,
        achieved_tflops=flops / step_s / TFLOPS,
        mfu=mfu(flops, step_s, peak),
        state_dtype=s.optim.state_dtype,
        state_mb=(state_bytes(run.optimizer) + master_weight_bytes(run.optimizer, run.model))
        / 2**20,
        # by class name: torchao is an optional extra, imported only by fp8 runs
        fp8_linears=sum(type(m).__name__ == "Float8Linear" for m in run.model.modules()),
        fp8_recipe=str(s.precision.fp8_recipe) if mode.fp8 else None,
    )


def release(device: torch.device, compiled: bool) -> None:
    """Free a measured run's memory before the next is built."""
    gc.collect()
    if compiled:
        torch._dynamo.reset()  # the next configuration compiles afresh, within dynamo's limits
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fill_speedups(rows: list[ThroughputRow]) -> None:
    """samples/s over the fp32 row with the same model, compile setting and batch."""
    baseline = {
        (r.model, r.compile, r.batch_size): r.samples_per_s for r in rows if r.precision == "fp32"
    }
    for row in rows:
        fp32 = baseline.get((row.model, row.compile, row.batch_size))
        row.speedup_vs_fp32 = row.samples_per_s / fp32 if fp32 else None


def part(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """One row per model x compile setting x precision; a failing row is recorded, not fatal."""
    rows: list[ThroughputRow] = []
    errors: list[dict[str, Any]] = []
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    flops: dict[str, int] = {}  # per model: counted once, the same in every precision
    for model, compiled, precision in itertools.product(args.models, compiles, args.precisions):
        overrides = throughput_overrides(args, model, precision, compiled)
        run = probe.build_run(
            probe.settings(overrides, quiet=False), args.out / "runs" / "throughput"
        )
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


def section(results: dict[str, list[Any]]) -> list[str]:
    rows: list[ThroughputRow] = results.get("throughput", [])
    errors: list[dict[str, Any]] = results.get("throughput_errors", [])
    cells = [
        [r.model, r.precision, record.fmt(r.compile), record.fmt(r.channels_last)]
        + [str(r.batch_size), record.fmt(r.first_step_s), f"{r.samples_per_s:.1f}"]
        + [f"{ms:.2f}" for ms in (r.step_ms, r.forward_ms, r.backward_ms, r.optimizer_ms)]
        + [f"{r.peak_memory_mb:.0f}", r.state_dtype, f"{r.state_mb:.2f}"]
        + [record.fmt(r.achieved_tflops), f"{100 * r.mfu:.1f}%" if r.mfu is not None else "—"]
        + [f"{r.speedup_vs_fp32:.2f}×" if r.speedup_vs_fp32 is not None else "—"]
        + [f"{r.fp8_linears} ({r.fp8_recipe})" if r.fp8_recipe else "—"]
        for r in rows
    ]
    cells += [
        [e["model"], e["precision"], record.fmt(e["compile"]), f"failed: {e['error']}"] + [""] * 14
        for e in errors
    ]
    return record.section(
        "Throughput",
        "model | precision | compile | channels_last | batch | first step s | samples/s | "
        "step ms | fwd ms | bwd ms | opt ms | peak MB | state | state MB | TFLOP/s | MFU | "
        "vs fp32 | fp8 Linears",
        cells,
    )
