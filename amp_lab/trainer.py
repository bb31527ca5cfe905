"""The loop: train a Run (amp_lab/build.py) to its end, record metrics and a summary.

Data flows one way: config -> build (phases) -> Run -> this loop -> sinks -> summary.json.
Per-step counters stay device tensors; values are read back to the host only at log steps, so
steps in between never wait for the device.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from typing import Any

import torch

from amp_lab.audit.audit import BrokenPromise
from amp_lab.checkpoint.run_dir import write_bytes_atomic
from amp_lab.checkpoint.signals import Interrupted
from amp_lab.components.augment import mix_batches
from amp_lab.components.ema import update_ema
from amp_lab.components.memory import grad_bytes, param_bytes
from amp_lab.components.metrics import ThroughputMeter, peak_memory_mb, reset_peak_memory
from amp_lab.precision.optimizer_state import master_weight_bytes, state_bytes, state_dtype_of
from amp_lab.records import SUMMARY_FILE
from amp_lab.run import Run
from amp_lab.search.trial import TrialPruned
from amp_lab.step import StepResult, evaluate, take
from amp_lab.tracking.sinks import Sink, Sinks

log = logging.getLogger(__name__)


class Trainer:
    """Trains a built Run; `fit()` returns the summary. `sinks`: more sinks for this loop (the
    bench's timer, a test's recorder), after the run's own."""

    def __init__(self, run: Run, sinks: list[Sink] | None = None) -> None:
        self.run = run
        self.extra_sinks = list(sinks or [])
        self.tracking: dict[str, Any] = {}
        self.setup_s = 0.0
        self.meter: ThroughputMeter | None = None

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end (or to divergence); write metrics.jsonl and summary.json."""
        run = self.run
        if run.finished is not None:
            log.warning(
                "%s already holds a finished run (%s after %d steps): nothing to train; "
                "trainer.resume=false trains it again",
                run.out_dir,
                run.finished["status"],
                run.finished["steps"],
            )
            run.dist.close()
            return run.finished
        run.out_dir.mkdir(parents=True, exist_ok=True)
        run.checkpointer.record_settings()
        info = run.describe()
        log.info(
            "%s on %s (rank %d of %d): peak LR %.4g (base %.4g, rule %s at global batch "
            "%d, scale %g), %d steps",
            info["precision"]["name"],
            run.device,
            run.dist.rank,
            run.dist.world_size,
            run.peak_lr,
            run.settings.lr.base,
            run.settings.lr.rule,
            run.global_batch,
            run.settings.lr.scale,
            run.total_steps,
        )
        sinks = Sinks([*run.sinks, *self.extra_sinks] if run.dist.is_main else [])
        started = time.perf_counter() - run.state.elapsed_s
        reset_peak_memory(run.device)  # this run's peak, not the process's (a local sweep)
        try:
            sinks.start({**info, "step": run.state.step})
            run.checkpointer.signals.before_hand_on = sinks.flush
            self.tracking = sinks.describe()
            # the training clock starts here: W&B's start-up (up to its init time-out) is setup
            started = time.perf_counter() - run.state.elapsed_s
            self.setup_s = time.perf_counter() - run.started_at
            with run.checkpointer.active():  # RNG states restored; stop signals caught
                self._loop(sinks, started)
            self._finish_health()
            self.tracking = sinks.describe()  # a W&B that stopped during the run says so
            summary = self.summary(time.perf_counter() - started, status=None)
            sinks.finish(summary)
        except BaseException as err:  # a stop signal's clean stop is resumable, not a crash
            status = (
                f"interrupted: {err}"
                if isinstance(err, Interrupted)
                else f"stopped: {err}"
                if isinstance(err, (BrokenPromise, TrialPruned))
                else f"crashed: {type(err).__name__}: {err}"
            )
            self.tracking = sinks.describe() or self.tracking
            self.write_summary(self.summary(time.perf_counter() - started, status=status))
            if isinstance(err, Exception):  # a Ctrl-C pending as a trial is pruned stops a sweep
                run.checkpointer.signals.after_run(run.state.step)
            raise
        finally:
            sinks.close()
            run.dist.close()
        self.write_summary(summary)
        run.checkpointer.signals.after_run(run.state.step)
        return summary

    def _loop(self, sinks: Sink, started: float) -> None:
        run = self.run
        t, st = run.settings.trainer, run.state
        meter = self.meter = ThroughputMeter(run.device, t.timing_warmup)
        meter.start(st.step)
        while st.step < run.total_steps and not st.diverged:
            run.sampler.set_epoch(st.epoch, st.batch_in_epoch * t.grad_accum)
            batches = run.data.train_batches(run.sampler)
            while st.batch_in_epoch < run.steps_per_epoch:
                fetch_start = time.perf_counter()
                micro_batches = mix_batches(run.mixup, take(batches, t.grad_accum))
                data_s = time.perf_counter() - fetch_start
                last = st.step + 1 >= run.total_steps
                log_step = (st.step + 1) % t.log_every == 0 or last
                with run.audit.around(st.step + 1):  # watches this start's first step only
                    result = run.train_step(micro_batches, step=st.step + 1)
                run.monitor.add(result)
                st.step += 1
                update_ema(run.ema, run.model, t.ema, st.step)
                st.batch_in_epoch += 1
                meter.step_done(st.step, result.samples, data_s)
                if log_step:
                    sinks.log(self._train_record(result, meter, started))
                epoch_end = st.batch_in_epoch == run.steps_per_epoch
                # an FSDP forward all-gathers: every rank evaluates, rank 0 alone records
                if (run.dist.is_main or run.dist.shards) and (
                    (t.eval_every and st.step % t.eval_every == 0)
                    or (not t.eval_every and epoch_end)
                    or last
                ):
                    sinks.log(self._eval_record(meter, started))
                meter.exclude(
                    run.checkpointer.step_done(
                        time.perf_counter() - started, final=last or st.diverged
                    )
                )
                if last or st.diverged:
                    break
            if st.batch_in_epoch == run.steps_per_epoch:
                st.epoch, st.batch_in_epoch = st.epoch + 1, 0

    def _train_record(
        self, result: StepResult, meter: ThroughputMeter, started: float
    ) -> dict[str, Any]:
        """A log step's record: the one host read of the monitor's window, the diagnostics, then
        the health judge on them, which decides whether the run stops here."""
        run, st = self.run, self.run.state
        monitor = run.monitor
        rows = monitor.read(st.step)
        window = monitor.window_totals(run.dist)
        record = {
            "kind": "train",
            "step": st.step,
            "epoch": st.step / run.steps_per_epoch,
            "time_s": self._train_clock(started),
            "train/loss": window["loss_sum"] / window["loss_count"]
            if window["loss_count"]
            else float("nan"),
            "train/acc": window["correct"] / max(1.0, window["samples"]),
            "train/lr": run.lr_at(st.step - 1),
            "train/grad_norm": result.grad_norm.item(),
            "amp/loss_scale": run.scaler.get_scale(),
            "amp/skipped_steps": monitor.history.skipped,
            "amp/skip_rate": window["skipped"] / len(rows.skips),
            **monitor.figures,  # the window's loss and gradient-norm spikes
            **self._device_figures(meter),
            **run.train_step.diagnostics.read(st.step, rows, monitor.history.first_bad),
        }
        lines = monitor.judge(rows, window, run.dist.world_size, record)
        self._warn(lines)
        st.diverged = monitor.diverged
        return record

    def _finish_health(self) -> None:
        """The end rules over the whole run (a final window with no finite loss is diverged)."""
        run = self.run
        self._warn(run.monitor.finish())
        run.state.diverged = run.monitor.diverged
        if run.dist.is_main:
            log.info(run.monitor.summary_line())

    def _warn(self, lines: list[str]) -> None:
        if self.run.dist.is_main:
            for line in lines:
                log.warning(line)

    def _device_figures(self, meter: ThroughputMeter) -> dict[str, float]:
        """Throughput and memory: totals over the ranks, and per-device figures."""
        run = self.run
        figures = {**meter.read(), "memory/peak_mb": peak_memory_mb(run.device)}
        if not run.dist.active:
            return figures
        local_rate = figures.get("throughput/samples_per_s", 0.0)
        memory = figures["memory/peak_mb"]
        totals = run.dist.all_reduce(
            torch.tensor([local_rate, memory], dtype=torch.float64, device=run.device)
        )
        peak = run.dist.all_reduce(
            torch.tensor([memory], dtype=torch.float64, device=run.device), op="max"
        )
        rate, figures["memory/peak_mb_total"] = totals.tolist()
        figures["memory/peak_mb"] = peak.item()
        if "throughput/samples_per_s" in figures:
            figures["throughput/samples_per_s"] = rate
            figures["throughput/samples_per_s_per_device"] = rate / run.dist.world_size
        return figures

    def _eval_record(self, meter: ThroughputMeter, started: float) -> dict[str, Any]:
        run = self.run
        st, t = run.state, run.settings.trainer
        eval_start = time.perf_counter()
        # the plain module: a DDP forward on rank 0 alone could wait on a buffer broadcast
        metrics = evaluate(run.model, run.data.val_batches(t.batch_size), run.policy)
        if run.ema is not None:  # the EMA under the same autocast policy as the model
            ema = evaluate(run.ema.module, run.data.val_batches(t.batch_size), run.policy)
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
            "epoch": st.step / run.steps_per_epoch,
            "time_s": now,
            **metrics,
        }

    def _train_clock(self, started: float) -> float:
        """Seconds of training so far: the loop's wall time less its evaluations."""
        return time.perf_counter() - started - self.run.state.eval_s

    # -- summary -----------------------------------------------------------------------------
    def summary(self, wall_time_s: float, status: str | None) -> dict[str, Any]:
        run = self.run
        st = run.state
        st.elapsed_s = wall_time_s
        if run.monitor.pending:  # a run that stopped mid-window: its last steps counted too
            run.monitor.read(st.step)
        local_rate = self.meter.mean_samples_per_s() if self.meter else None
        return {
            "status": status or ("diverged" if st.diverged else "completed"),
            "diverged": st.diverged,
            "steps": st.step,
            "epochs": st.step / run.steps_per_epoch,
            "final_val_acc": st.final_val_acc,
            "best_val_acc": st.best_val_acc,
            "final_val_loss": st.final_val_loss,
            "target_acc": run.settings.trainer.target_acc,
            "steps_to_target": st.steps_to_target,
            "time_to_target_s": st.time_to_target_s,
            # ranks step in lockstep (each step waits for the gradient all-reduce): total = x world
            "mean_samples_per_s": local_rate * run.dist.world_size if local_rate else None,
            "skipped_steps": run.monitor.history.skipped,
            "final_loss_scale": run.scaler.get_scale(),
            "peak_memory_mb": peak_memory_mb(run.device),
            # per rank, from the tensors' sizes (state is created at the first step)
            "optimizer_state_dtype": state_dtype_of(run.optimizer),
            "optimizer_state_bytes": state_bytes(run.optimizer),
            "master_weight_bytes": master_weight_bytes(run.optimizer, run.model),
            "param_bytes": param_bytes(run.model),  # FSDP: this rank's shards
            "grad_bytes": grad_bytes(run.model),
            "wall_time_s": wall_time_s,  # the loop: training, evaluation, checkpoints
            "train_time_s": wall_time_s - st.eval_s,  # the training clock of time_s
            "eval_s": st.eval_s,
            "setup_s": self.setup_s,  # building the run and starting the trackers (this attempt)
            "threads": asdict(run.threads),
            "tracking": self.tracking,
            "output_dir": str(run.out_dir),
            "diagnostics": run.train_step.diagnostics.summary(run.monitor.history.first_bad),
            "health": run.monitor.entries(),  # the judge's findings (amp_lab/health/rules.py)
            "precision_audit": run.audit.summary(),  # what the first step ran in (amp_lab/audit/)
            **run.describe(),
        }

    def write_summary(self, summary: dict[str, Any]) -> None:
        if not self.run.dist.is_main:
            return
        write_bytes_atomic(self.run.out_dir / SUMMARY_FILE, json.dumps(summary, indent=2).encode())
