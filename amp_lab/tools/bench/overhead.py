"""`--parts overhead`: a run's whole loop (`Trainer.fit`) against a bare hand-written loop
(autocast, GradScaler, AdamW, nothing else), round for round in one process under the same load:
whatever the runner does per step (meters, records, sinks, diagnostics) is the difference."""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.amp import GradScaler
from torch.utils.data import TensorDataset

from amp_lab.choices import CompileMode
from amp_lab.components.compile import compile_model, compile_optimizer_step
from amp_lab.components.metrics import synchronize
from amp_lab.config import AmpLabConfig, ConfigError
from amp_lab.precision.modes import PRECISION_MODES
from amp_lab.run import Run
from amp_lab.tools import probe
from amp_lab.tools.bench import record
from amp_lab.tools.bench.runs import Report, synthetic_overrides
from amp_lab.tools.bench.throughput import release
from amp_lab.tracking.sinks import Sink

WARMUP_ROUNDS = 1  # rounds of each run left out: allocator growth, autotuning, compilation


class BareLoop:
    """The hand-written baseline: a copy of the runner's model, its data, batch and precision."""

    def __init__(self, run: Run) -> None:
        if not isinstance(run.data.train, TensorDataset):
            raise ConfigError("the overhead bench needs in-memory data (data=synthetic or digits)")
        t, mode = run.settings.trainer, run.policy.mode
        self.device = run.device
        copies: dict[int, Any] = {}  # deepcopy's memo: id of each original -> its copy
        self.model = copy.deepcopy(run.model, copies)  # same architecture and initial weights
        # the runner's parameter groups and their weight decay, over the copy's parameters
        groups = [
            {"params": [copies.get(id(p)) for p in g["params"]], "weight_decay": g["weight_decay"]}
            for g in run.optimizer.param_groups
        ]
        if any(p is None for group in groups for p in group["params"]):
            raise ConfigError("the overhead bench needs an optimizer over the model's own weights")
        compiled = t.compile != CompileMode.off  # compiled as the runner's model and step are
        self.forward = compile_model(self.model, t.compile_backend) if compiled else self.model
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=run.peak_lr,
            fused=run.optimizer.defaults.get("fused") or None,  # as fused as the runner's AdamW
            foreach=False if t.compile == CompileMode.step else None,  # as the runner's is built
        )
        if t.compile == CompileMode.step:
            compile_optimizer_step(self.optimizer, t.compile_backend)
        self.scaler = GradScaler(
            self.device.type,
            init_scale=run.settings.scaler.init_scale,
            enabled=mode.dynamic_scaling,
        )
        self.dtype = mode.autocast_dtype
        self.channels_last = run.data.channels_last  # as the runner's batches arrive
        self.images, self.labels = run.data.train.tensors
        self.batch_size, self.position = t.batch_size, len(self.labels)  # shuffle on first use
        self.order = torch.empty(0, dtype=torch.long, device=self.images.device)

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + self.batch_size > len(self.labels):  # a new epoch, shuffled on device
            self.order = torch.randperm(len(self.labels), device=self.images.device)
            self.position = 0
        idx = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        images, labels = self.images[idx], self.labels[idx]  # the data already lives on device
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels

    def run(self, steps: int) -> None:
        """`steps` optimizer steps of the textbook AMP recipe."""
        for _ in range(steps):
            images, labels = self._batch()
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast(
                self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None
            ):
                logits = self.forward(images)
            loss = F.cross_entropy(logits.float(), labels)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()


def _clocks(device: torch.device) -> tuple[float, float]:
    """Wall time and this process's CPU time, after the device has finished its work."""
    synchronize(device)
    return time.perf_counter(), time.process_time()


class AlternatingSink(Sink):
    """Closes an amp_lab round at every `steps`-th train record, then times one bare round.
    Each amp_lab round is compared with the mean of the bare rounds around it, so a drifting load
    cancels; on the wall clock and in process CPU time (the steadier on a shared CPU)."""

    def __init__(self, bare: BareLoop, steps: int, device: torch.device) -> None:
        self.bare, self.steps, self.device = bare, steps, device
        self.amp: list[tuple[float, float]] = []  # (wall s, CPU s) per round
        self.bare_rounds: list[tuple[float, float]] = []
        self.mark = (0.0, 0.0)

    def _bare_round(self, start: tuple[float, float]) -> None:
        """One timed bare round from `start`; the next amp_lab round starts as it ends."""
        self.bare.run(self.steps)
        self.mark = _clocks(self.device)
        self.bare_rounds.append((self.mark[0] - start[0], self.mark[1] - start[1]))

    def start(self, info: dict[str, Any]) -> None:
        self.bare.run(self.steps)  # the bare loop's own warm-up (allocator, autotuning, compile)
        self._bare_round(_clocks(self.device))  # the bare round before the first amp_lab round

    def log(self, record: dict[str, Any]) -> None:
        if record.get("kind") != "train" or record["step"] % self.steps:
            return
        now = _clocks(self.device)
        self.amp.append((now[0] - self.mark[0], now[1] - self.mark[1]))
        self._bare_round(now)


@dataclass
class OverheadResult:
    """Per-round times of both loops and the medians of their ratios."""

    model: str
    variant: str
    precision: str
    steps_per_round: int
    amp_lab_ms: list[float] = field(default_factory=list)  # wall ms per step, per timed round
    bare_ms: list[float] = field(default_factory=list)  # mean of the two bare rounds around it
    ratios: list[float] = field(default_factory=list)  # amp_lab / bare wall time, per round
    cpu_ratios: list[float] = field(default_factory=list)  # the same in process CPU time
    run_medians: list[float] = field(default_factory=list)  # each run's median ratio
    median_ratio: float = math.nan  # of all runs' rounds
    median_cpu_ratio: float = math.nan


def measure_overhead(
    settings: AmpLabConfig, run_dirs: list[Path], steps: int, variant: str
) -> OverheadResult:
    """One row: a run and its bare copy built afresh in each of `run_dirs`, rounds pooled."""
    result = OverheadResult(settings.model.name, variant, str(settings.precision.name), steps)
    for run_dir in run_dirs:
        run = probe.build_run(settings, run_dir)
        sink = AlternatingSink(BareLoop(run), steps, run.device)
        run_dir.mkdir(parents=True, exist_ok=True)
        with (run_dir / "console.log").open("w") as log, contextlib.redirect_stderr(log):
            probe.train(run, [sink])
        around = [
            ((w0 + w1) / 2, (c0 + c1) / 2)  # the bare rounds before and after each amp round
            for (w0, c0), (w1, c1) in zip(sink.bare_rounds, sink.bare_rounds[1:])
        ]
        timed = list(zip(sink.amp, around))[WARMUP_ROUNDS:]
        if not timed:
            raise RuntimeError(f"overhead run {variant}/{result.precision} timed no round")
        for (amp_s, amp_cpu), (bare_s, bare_cpu) in timed:
            result.amp_lab_ms.append(1000 * amp_s / steps)
            result.bare_ms.append(1000 * bare_s / steps)
            result.ratios.append(amp_s / bare_s)
            result.cpu_ratios.append(amp_cpu / bare_cpu)
        result.run_medians.append(statistics.median(result.ratios[-len(timed) :]))
        device = run.device
        del run, sink
        release(device, settings.trainer.compile != CompileMode.off)
    result.median_ratio = statistics.median(result.ratios)
    result.median_cpu_ratio = statistics.median(result.cpu_ratios)
    return result


def part(args: argparse.Namespace, device: torch.device, report: Report) -> None:
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
        if PRECISION_MODES[precision].param_dtype != torch.float32:
            print(
                f"overhead {model} {variant} {precision}: skipped, the bare recipe (autocast over "
                "fp32 weights) has no pure 16-bit weights",
                file=sys.stderr,
            )
            continue
        extra = [] if variant == "default" else variant.split()
        # the user's run as it is (W&B and all): the runner's overhead, not a quiet probe's
        overrides = synthetic_overrides(args, model, precision, *timing, *extra)
        settings = probe.settings(overrides, quiet=False)
        if args.steps % settings.trainer.log_every:
            every = settings.trainer.log_every
            raise ConfigError(
                f"--steps {args.steps} must be a multiple of trainer.log_every={every}; use --steps"
                f" {every} (or a multiple), or add --override trainer.log_every={args.steps}"
            )
        row = args.out / "runs" / f"overhead_{model}_{variant.replace(' ', '_')}_{precision}"
        run_dirs = [row.with_name(f"{row.name}_run{i}") for i in range(2, args.repeats + 1)]
        label = variant  # 'default' named for what it is, so a table read later says so
        if variant == "default":
            label = f"default (diagnostics={settings.diagnostics.mode}, W&B {settings.logger.mode})"
        result = measure_overhead(settings, [row, *run_dirs], args.steps, label)
        results.append(result)
        runs = ", ".join(f"{m:.3f}" for m in result.run_medians)
        print(
            f"overhead {model} {result.variant} {precision}: median ratio "
            f"{result.median_ratio:.3f}" + (f" (runs: {runs})" if args.repeats > 1 else ""),
            file=sys.stderr,
        )
        report(overhead=results)


def section(reported: dict[str, list[Any]]) -> list[str]:
    results: list[OverheadResult] = reported.get("overhead", [])
    rows = [
        [r.model, r.variant, r.precision, f"{statistics.median(r.amp_lab_ms):.2f}"]
        + [f"{statistics.median(r.bare_ms):.2f}", f"**{r.median_ratio:.3f}**"]
        + [f"{x:.3f}" for x in (min(r.ratios), max(r.ratios), r.median_cpu_ratio)]
        + [str(len(r.ratios)), ", ".join(f"{m:.3f}" for m in r.run_medians)]
        for r in results
    ]
    return record.section(
        "Overhead: amp_lab step / bare loop (median of rounds; wall time, and process CPU time)",
        "model | variant | precision | amp_lab ms/step | bare ms/step | median ratio | min | "
        "max | CPU-time ratio | rounds | runs' median ratios",
        rows,
    )
