"""The runner: build everything from the config, run the loop, record metrics and a summary.

Data flows one way: config -> build (data, model, precision, optimizer, schedule, scaler) ->
loop -> sinks -> summary.json. Per-step counters stay device tensors; values are read back to the
host only at log steps, so steps in between never wait for the device.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from amp_lab.checkpoint.signals import Interrupted
from amp_lab.checkpoint.store import Checkpointer
from amp_lab.choices import CompileMode
from amp_lab.components.augment import build_mixup, mix_batches
from amp_lab.components.compile import (
    check_backend,
    compile_model,
    compile_optimizer_step,
    optimizer_to_compile,
)
from amp_lab.components.data import EpochBatchSampler, build_data
from amp_lab.components.distributed import setup as setup_distributed
from amp_lab.components.ema import build_ema, update_ema
from amp_lab.components.fsdp import resolve_plan, shard_model
from amp_lab.components.loss import build_loss
from amp_lab.components.lr import build_scheduler, lr_factor, peak_lr, warmup_length
from amp_lab.components.memory import grad_bytes, param_bytes
from amp_lab.components.metrics import ThroughputMeter, peak_memory_mb, reset_peak_memory
from amp_lab.components.models import build_model, check_input_fits, place
from amp_lab.components.optim import build_optimizer
from amp_lab.components.threads import apply_threads
from amp_lab.config import AmpLabConfig, ConfigError
from amp_lab.numerics.counters import DeviceCounters
from amp_lab.numerics.diagnostics import build_diagnostics
from amp_lab.numerics.health import RunHealth, Window
from amp_lab.numerics.pitfalls import prepare_model, step_class
from amp_lab.parts import BuiltParts
from amp_lab.precision.fp32_modules import keep_in_fp32
from amp_lab.precision.modes import resolve_device, resolve_precision
from amp_lab.precision.optimizer_state import master_weight_bytes, state_bytes, state_dtype_of
from amp_lab.precision.scaling import build_scaler, scaler_stop_reason, uses_dynamic_scaling
from amp_lab.records import METRICS_FILE, SUMMARY_FILE
from amp_lab.step import StepResult, TrainStep, evaluate, take
from amp_lab.tracking.sinks import ConsoleSink, JsonlSink, Sink, Sinks
from amp_lab.tracking.wandb_sink import build_tracking_sinks

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


@dataclass
class LoopState:
    """Where the loop stands: enough to resume at the next optimizer step."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # optimizer steps done in the current epoch
    best_val_acc: float | None = None
    final_val_acc: float | None = None
    final_val_loss: float | None = None
    steps_to_target: int | None = None
    time_to_target_s: float | None = None
    elapsed_s: float = 0.0  # wall time of the loop, carried over a resume
    eval_s: float = 0.0  # of elapsed_s, spent evaluating: outside the training clock
    diverged: bool = False


class Trainer:
    """Builds a run from typed settings; `fit()` trains it and returns the summary."""

    def __init__(self, settings: AmpLabConfig, out_dir: Path, sinks: list[Sink] | None = None):
        self.created = time.perf_counter()  # setup_s: from here to the first step
        t = settings.trainer
        self.threads = apply_threads(t.threads, settings.data.num_workers)
        if self.threads.workers != settings.data.num_workers:
            settings = replace(
                settings, data=replace(settings.data, num_workers=self.threads.workers)
            )
        self.tracking: dict[str, Any] = {}
        self.setup_s = 0.0
        self.dist = setup_distributed(t.strategy, t.device)
        self.settings = settings
        self.out_dir = Path(self.dist.broadcast(str(out_dir)))  # rank 0's run directory
        self.extra_sinks = sinks or []
        seed_everything(t.seed)
        self.device = resolve_device(self.dist.device(t.device))
        torch.backends.cudnn.benchmark = self.device.type == "cuda"  # time conv algorithms once
        self.policy = resolve_precision(settings.precision.name, self.device, settings.precision)
        self.fsdp = resolve_plan(settings) if self.dist.shards else None
        self.data = build_data(
            settings.data, t.seed, self.device, settings.model.name, settings.model.channels_last
        )
        self.mixup = build_mixup(settings.data, self.data.spec.num_classes, t.batch_size)
        self.model = place(build_model(settings.model, self.data.spec), self.device)
        check_input_fits(self.model, settings.model.name, self.data.spec, self.device)
        keep_in_fp32(self.model, settings.precision.fp32_modules, self.device)
        prepare_model(self.model, settings.fault, settings.pitfall.name)  # pitfall lab faults
        if self.fsdp is not None:  # DTensor shards replace the parameters: before the optimizer
            shard_model(self.model, settings.fsdp.wrap, self.fsdp)
        self.sampler = EpochBatchSampler(
            len(self.data.train), t.batch_size, t.seed, self.dist.rank, self.dist.world_size
        )
        self.steps_per_epoch = len(self.sampler) // t.grad_accum
        self.global_batch = t.batch_size * t.grad_accum * self.dist.world_size
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"the global batch (batch_size x grad_accum x ranks) = "
                f"{self.global_batch} exceeds the {len(self.data.train)} training "
                f"samples; lower it"
            )
        self.total_steps = t.max_steps or t.epochs * self.steps_per_epoch
        self.peak_lr = peak_lr(settings.lr, self.global_batch)
        self.warmup = warmup_length(settings.lr, self.steps_per_epoch)
        if self.warmup >= self.total_steps:
            log.warning(
                "the LR warmup (%d steps) is as long as the run (%d steps): the LR never "
                "reaches its peak; shorten lr.warmup_steps / lr.warmup_epochs",
                self.warmup,
                self.total_steps,
            )
        self.optimizer = build_optimizer(
            self.model, optimizer_to_compile(settings.optim, t.compile), self.peak_lr
        )
        # fp8, 16-bit weights; the pure modes swap fp32 masters into the optimizer's param
        # groups. The step needs the hook it returns, so it is built after and captures those.
        before_unscale = self.policy.prepare(self.model, self.optimizer)
        self.scheduler = build_scheduler(
            self.optimizer, settings.lr, self.total_steps, self.steps_per_epoch
        )
        self.scaler = build_scaler(settings.scaler, self.policy)
        self.ema = build_ema(self.model, t.ema)  # after prepare: a copy of the cast weights
        parallel_model = self.dist.wrap(self.model, self.device)
        forward_model = parallel_model
        if t.compile != CompileMode.off:
            check_backend(t.compile_backend)
            forward_model = compile_model(parallel_model, t.compile_backend)
        # built once, of the class the pitfall lab picks; it builds its numerics observer from
        # its own view as it is built (nothing is swapped or attached afterwards)
        make_step = step_class(settings.pitfall.name, settings.fault)
        self.train_step: TrainStep = make_step(
            forward_model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.policy,
            before_unscale,
            t.clip_grad,
            t.clip_mode,
            self.dist.micro_batch_context(parallel_model),
            observe=functools.partial(
                build_diagnostics,
                settings.diagnostics,
                settings.scaler,
                uses_dynamic_scaling(settings.scaler, self.policy),
                t.log_every,
                self.out_dir if self.dist.is_main else None,
            ),
            loss=build_loss(settings.data),
        )
        self.diagnostics = self.train_step.diagnostics
        self.parts = BuiltParts(
            settings,
            self.device,
            self.policy,
            self.data,
            self.sampler,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.train_step,
            self.steps_per_epoch,
            self.global_batch,
            self.peak_lr,
        )
        self.health = RunHealth(
            settings.diagnostics,
            uses_dynamic_scaling(settings.scaler, self.policy),
            float(self.scaler.get_scale()),
            math.log(self.data.spec.num_classes),
        )
        self.state = LoopState()
        self.counters = DeviceCounters(self.device, t.log_every)
        self.checkpointer = Checkpointer(
            settings,
            self.out_dir,
            self.state,
            {
                "model": self.model,
                "optimizer": self.optimizer,
                "scheduler": self.scheduler,
                "scaler": self.scaler,
                "counters": self.counters,
                "diagnostics": self.diagnostics,
                "health": self.health,
                **({"ema": self.ema} if self.ema else {}),
            },
            self.dist,
        )
        # A run dir whose run finished keeps its results (a relaunched sweep trains only what
        # did not finish); one holding a checkpoint resumes from it.
        self.finished = self.checkpointer.finished() if t.resume else None
        if self.finished is None:
            self.checkpointer.restore()
        if t.compile == CompileMode.step:  # after the restore, which puts back a saved LR
            compile_optimizer_step(self.optimizer, t.compile_backend)

    # -- reporting ---------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {
            "precision": self.policy.describe(),
            "scaler": {"dynamic": uses_dynamic_scaling(s.scaler, self.policy), **asdict(s.scaler)},
            "lr": {
                "peak": self.peak_lr,
                "base": s.lr.base,
                "rule": s.lr.rule,
                "scale": s.lr.scale,
                "global_batch": self.global_batch,
                "warmup_steps": self.warmup,
                "schedule": s.lr.schedule,
            },
            "model": s.model.name,
            "params": sum(p.numel() for p in self.model.parameters()),
            "data": s.data.name,
            "data_root": s.data.root,  # as resolved (e.g. from ${oc.env:CIFAR_ROOT})
            "world_size": self.dist.world_size,
            **({"fsdp": self.fsdp.describe()} if self.fsdp else {}),
            "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch,
        }

    def lr_at(self, step: int) -> float:
        return self.peak_lr * lr_factor(step, self.total_steps, self.warmup, self.settings.lr)

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end (or to divergence); write metrics.jsonl and summary.json."""
        if self.finished is not None:
            log.warning(
                "%s already holds a finished run (%s after %d steps): nothing to train; "
                "trainer.resume=false trains it again",
                self.out_dir,
                self.finished["status"],
                self.finished["steps"],
            )
            self.dist.close()
            return self.finished
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.checkpointer.record_settings()
        t = self.settings.trainer
        info = self.describe()
        log.info(
            "%s on %s (rank %d of %d): peak LR %.4g (base %.4g, rule %s at global batch "
            "%d, scale %g), %d steps",
            info["precision"]["name"],
            self.device,
            self.dist.rank,
            self.dist.world_size,
            self.peak_lr,
            self.settings.lr.base,
            self.settings.lr.rule,
            self.global_batch,
            self.settings.lr.scale,
            self.total_steps,
        )
        sinks = Sinks(
            [
                JsonlSink(self.out_dir / METRICS_FILE),  # rank 0 alone writes
                ConsoleSink(self.total_steps, t.progress),
                *self.extra_sinks,
                *build_tracking_sinks(self.settings, self.out_dir),
            ]
            if self.dist.is_main
            else []
        )
        started = time.perf_counter() - self.state.elapsed_s
        reset_peak_memory(self.device)  # this run's peak, not the process's (a local sweep)
        try:
            sinks.start({**info, "step": self.state.step})
            self.tracking = sinks.describe()
            # the training clock starts here: W&B's start-up (up to its init time-out) is setup
            started = time.perf_counter() - self.state.elapsed_s
            self.setup_s = time.perf_counter() - self.created
            with self.checkpointer.active():  # RNG states restored; stop signals caught
                self._loop(sinks, started)
            self._finish_health()
            self.tracking = sinks.describe()  # a W&B that stopped during the run says so
            summary = self.summary(time.perf_counter() - started, status=None)
            sinks.finish(summary)
        except BaseException as err:  # a stop signal's clean stop is resumable, not a crash
            status = (
                f"interrupted: {err}"
                if isinstance(err, Interrupted)
                else f"crashed: {type(err).__name__}: {err}"
            )
            self.tracking = sinks.describe() or self.tracking
            self.write_summary(self.summary(time.perf_counter() - started, status=status))
            raise
        finally:
            sinks.close()
            self.dist.close()
        self.write_summary(summary)
        return summary

    def _loop(self, sinks: Sink, started: float) -> None:
        t, st = self.settings.trainer, self.state
        meter = ThroughputMeter(self.device, t.timing_warmup)
        counters = self.counters
        self.meter, self.skipped_total = meter, 0
        meter.start(st.step)
        while st.step < self.total_steps and not st.diverged:
            self.sampler.set_epoch(st.epoch, st.batch_in_epoch * t.grad_accum)
            batches = self.data.train_batches(self.sampler)
            while st.batch_in_epoch < self.steps_per_epoch:
                fetch_start = time.perf_counter()
                micro_batches = mix_batches(self.mixup, take(batches, t.grad_accum))
                data_s = time.perf_counter() - fetch_start
                last = st.step + 1 >= self.total_steps
                log_step = (st.step + 1) % t.log_every == 0 or last
                result = self.train_step(micro_batches, measure_norm=log_step, step=st.step + 1)
                counters.add(result)
                st.step += 1
                update_ema(self.ema, self.model, t.ema, st.step)
                st.batch_in_epoch += 1
                meter.step_done(st.step, result.samples, data_s)
                if log_step:
                    sinks.log(self._train_record(counters, result, meter, started))
                epoch_end = st.batch_in_epoch == self.steps_per_epoch
                # an FSDP forward all-gathers: every rank evaluates, rank 0 alone records
                if (self.dist.is_main or self.dist.shards) and (
                    (t.eval_every and st.step % t.eval_every == 0)
                    or (not t.eval_every and epoch_end)
                    or last
                ):
                    sinks.log(self._eval_record(meter, started))
                meter.exclude(
                    self.checkpointer.step_done(
                        time.perf_counter() - started, final=last or st.diverged
                    )
                )
                if last or st.diverged:
                    break
            if st.batch_in_epoch == self.steps_per_epoch:
                st.epoch, st.batch_in_epoch = st.epoch + 1, 0

    def _train_record(
        self, counters: DeviceCounters, result: StepResult, meter: ThroughputMeter, started: float
    ) -> dict[str, Any]:
        st, t = self.state, self.settings.trainer
        counters.reduce(self.dist)
        c = counters.read_window()
        steps_in_window = (st.step - 1) % t.log_every + 1
        assert result.grad_norm is not None, "a log step measures the gradient norm"
        self.skipped_total = int(c["skipped"])
        if c["worst_streak"] >= t.max_bad_steps:
            st.diverged = True
            log.warning(
                "step %d: %d consecutive non-finite steps (trainer.max_bad_steps=%d); "
                "stopping as diverged",
                st.step,
                int(c["worst_streak"]),
                t.max_bad_steps,
            )
        if (reason := scaler_stop_reason(self.scaler)) is not None:
            st.diverged = True
            log.warning("step %d: %s; stopping as diverged", st.step, reason)
        record = {
            "kind": "train",
            "step": st.step,
            "epoch": st.step / self.steps_per_epoch,
            "time_s": self._train_clock(started),
            "train/loss": c["loss_sum"] / c["loss_count"] if c["loss_count"] else float("nan"),
            "train/acc": c["correct"] / max(1.0, c["samples"]),
            "train/lr": self.lr_at(st.step - 1),
            "train/grad_norm": result.grad_norm.item(),
            "amp/loss_scale": self.scaler.get_scale(),
            "amp/skipped_steps": self.skipped_total,
            "amp/skip_rate": c["window_skipped"] / steps_in_window,
            **self._device_figures(meter),
            **self.diagnostics.read(st.step),
        }
        self._observe_health(c, steps_in_window, record)
        return record

    def _observe_health(self, c: dict[str, float], steps: int, record: dict[str, Any]) -> None:
        """The run-health rules, fed with what this log step has read already (no sync)."""
        window = Window(
            self.state.step,
            steps,
            round(c["loss_count"] / self.dist.world_size),
            int(c["window_skipped"]),
            record["train/loss"],
            record["amp/loss_scale"],
        )
        for line in self.health.observe(window, record.get("diag/grad_zero_share")):
            if self.dist.is_main:
                log.warning(line)

    def _finish_health(self) -> None:
        """The whole-run rules; a final window with no finite loss ends the run diverged."""
        for line in self.health.finish(self.state.step, self.skipped_total):
            if self.dist.is_main:
                log.warning(line)
        if self.health.final_nonfinite():
            self.state.diverged = True
        if self.dist.is_main:
            log.info(self.health.summary_line())

    def _device_figures(self, meter: ThroughputMeter) -> dict[str, float]:
        """Throughput and memory: totals over the ranks, and per-device figures."""
        figures = {**meter.read(), "memory/peak_mb": peak_memory_mb(self.device)}
        if not self.dist.active:
            return figures
        world = self.dist.world_size
        local_rate = figures.get("throughput/samples_per_s", 0.0)
        memory = figures["memory/peak_mb"]
        totals = self.dist.all_reduce(
            torch.tensor([local_rate, memory], dtype=torch.float64, device=self.device)
        )
        peak = self.dist.all_reduce(
            torch.tensor([memory], dtype=torch.float64, device=self.device), op="max"
        )
        rate, memory_total = totals.tolist()
        figures.update({"memory/peak_mb": peak.item(), "memory/peak_mb_total": memory_total})
        if "throughput/samples_per_s" in figures:
            figures.update(
                {
                    "throughput/samples_per_s": rate,
                    "throughput/samples_per_s_per_device": rate / world,
                }
            )
        return figures

    def _eval_record(self, meter: ThroughputMeter, started: float) -> dict[str, Any]:
        st, t = self.state, self.settings.trainer
        eval_start = time.perf_counter()
        # the plain module: a DDP forward on rank 0 alone could wait on a buffer broadcast
        metrics = evaluate(self.model, self.data.val_batches(t.batch_size), self.policy)
        if self.ema is not None:  # the EMA under the same autocast policy as the model
            ema = evaluate(self.ema.module, self.data.val_batches(t.batch_size), self.policy)
            metrics.update({"val/acc_ema": ema["val/acc"], "val/loss_ema": ema["val/loss"]})
        meter.exclude(time.perf_counter() - eval_start)
        st.eval_s += time.perf_counter() - eval_start
        now = self._train_clock(started)
        acc = metrics["val/acc"]
        st.final_val_acc, st.final_val_loss = acc, metrics["val/loss"]
        st.best_val_acc = acc if st.best_val_acc is None else max(st.best_val_acc, acc)
        if st.steps_to_target is None and acc >= t.target_acc:
            st.steps_to_target, st.time_to_target_s = st.step, now
        return {
            "kind": "val",
            "step": st.step,
            "epoch": st.step / self.steps_per_epoch,
            "time_s": now,
            **metrics,
        }

    def _train_clock(self, started: float) -> float:
        """Seconds of training so far: the loop's wall time less its evaluations."""
        return time.perf_counter() - started - self.state.eval_s

    # -- summary -----------------------------------------------------------------------------
    def summary(self, wall_time_s: float, status: str | None) -> dict[str, Any]:
        st = self.state
        st.elapsed_s = wall_time_s
        meter = getattr(self, "meter", None)
        local_rate = meter.mean_samples_per_s() if meter else None
        return {
            "status": status or ("diverged" if st.diverged else "completed"),
            "diverged": st.diverged,
            "steps": st.step,
            "epochs": st.step / self.steps_per_epoch,
            "final_val_acc": st.final_val_acc,
            "best_val_acc": st.best_val_acc,
            "final_val_loss": st.final_val_loss,
            "target_acc": self.settings.trainer.target_acc,
            "steps_to_target": st.steps_to_target,
            "time_to_target_s": st.time_to_target_s,
            # ranks step in lockstep (each step waits for the gradient all-reduce): total = x world
            "mean_samples_per_s": local_rate * self.dist.world_size if local_rate else None,
            "skipped_steps": getattr(self, "skipped_total", 0),
            "final_loss_scale": self.scaler.get_scale(),
            "peak_memory_mb": peak_memory_mb(self.device),
            # per rank, from the tensors' sizes (state is created at the first step)
            "optimizer_state_dtype": state_dtype_of(self.optimizer),
            "optimizer_state_bytes": state_bytes(self.optimizer),
            "master_weight_bytes": master_weight_bytes(self.optimizer, self.model),
            "param_bytes": param_bytes(self.model),  # FSDP: this rank's shards
            "grad_bytes": grad_bytes(self.model),
            "wall_time_s": wall_time_s,  # the loop: training, evaluation, checkpoints
            "train_time_s": wall_time_s - st.eval_s,  # the training clock of time_s
            "eval_s": st.eval_s,
            "setup_s": self.setup_s,  # building the run and starting the trackers (this attempt)
            "threads": asdict(self.threads),
            "tracking": self.tracking,
            "output_dir": str(self.out_dir),
            "diagnostics": self.diagnostics.summary(),
            "health": list(self.health.entries),  # silent failures (amp_lab/numerics/health.py)
            **self.describe(),
        }

    def write_summary(self, summary: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        path = self.out_dir / SUMMARY_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(path)  # atomic: a reader never sees half a summary
