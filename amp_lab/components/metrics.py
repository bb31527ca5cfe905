"""Throughput, step time, data-loading share and peak memory, measured honestly.

The clock is read after a device synchronisation at log-window boundaries only; the first
`timing_warmup` steps (allocator growth, autotuning, compilation) are left out.
"""

from __future__ import annotations

import contextlib
import resource
import time
from pathlib import Path

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak, as the runs of a local sweep share one process (Linux: clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak bytes allocated by tensors; CPU: peak RSS since the last reset (Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError, ValueError, IndexError):
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024  # in kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class ThroughputMeter:
    """Samples/s and step time per log window, plus run totals, excluding warm-up steps."""

    def __init__(self, device: torch.device, warmup_steps: int) -> None:
        self.device, self.warmup_steps = device, warmup_steps
        self.window_start: float | None = None
        self.window_steps = self.window_samples = 0
        self.window_data_s = self.window_excluded_s = 0.0
        self.total_s, self.total_samples = 0.0, 0

    def _open(self) -> None:
        synchronize(self.device)
        self.window_start = time.perf_counter()

    def start(self, step: int) -> None:
        """Call before the first step (`step` steps already done, e.g. after a resume)."""
        if step >= self.warmup_steps:
            self._open()

    def step_done(self, step: int, samples: int, data_s: float) -> None:
        """Call after every optimizer step; `step` counts the steps done so far."""
        if self.window_start is None:
            if step == self.warmup_steps:
                self._open()  # timing begins once the warm-up steps are done
            return
        self.window_steps += 1
        self.window_samples += samples
        self.window_data_s += data_s

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training steps (evaluation, checkpoints) out of the window."""
        if self.window_start is not None:
            self.window_excluded_s += seconds

    def read(self) -> dict[str, float]:
        """Close the current window and open the next: its figures, or {} while warming up."""
        if self.window_start is None or self.window_steps == 0:
            return {}
        synchronize(self.device)
        now = time.perf_counter()
        elapsed = now - self.window_start - self.window_excluded_s
        self.total_s += elapsed
        self.total_samples += self.window_samples
        figures = {
            "throughput/samples_per_s": self.window_samples / elapsed,
            "throughput/step_ms": 1000 * elapsed / self.window_steps,
            "throughput/data_share": min(1.0, self.window_data_s / elapsed),
        }
        self.window_steps = self.window_samples = 0
        self.window_data_s = self.window_excluded_s = 0.0
        self.window_start = now
        return figures

    def mean_samples_per_s(self) -> float | None:
        return self.total_samples / self.total_s if self.total_s > 0 else None
