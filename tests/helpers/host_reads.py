"""Count the calls that would sync host and device (Tensor.item, float(t), ...) while a real
Trainer loop runs, outside its log records; on CUDA the loop runs under set_sync_debug_mode."""

from __future__ import annotations

import contextlib
import functools
import sys
import traceback

import torch

from amp_lab.components.data import EpochBatchSampler
from amp_lab.components.metrics import ThroughputMeter
from amp_lab.trainer import Trainer

HOST_READS = ["item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy"]

# Logs at steps 2, 4 and 5 (the last); warm-up ends at step 1. A small val set: eval is not
# under test, and fp16 on CPU is slow.
LOOP = [
    "trainer.max_steps=5",
    "trainer.log_every=2",
    "trainer.timing_warmup=1",
    "data.val_fraction=0.05",
]


class HostReadWatch:
    """Armed while the loop runs; disarmed inside log records, where reading values is the job."""

    def __init__(self, on_cuda: bool) -> None:
        self.on_cuda, self.depth, self.armed = on_cuda, 0, False
        self.calls: list[str] = []

    @contextlib.contextmanager
    def arm(self):
        self.armed = True
        self._set_debug_mode()
        try:
            yield
        finally:
            self.armed = False
            self._set_debug_mode()

    @contextlib.contextmanager
    def pause(self):
        self.depth += 1
        self._set_debug_mode()
        try:
            yield
        finally:
            self.depth -= 1
            self._set_debug_mode()

    def _set_debug_mode(self) -> None:
        if self.on_cuda:
            active = self.armed and self.depth == 0
            torch.cuda.set_sync_debug_mode("error" if active else "default")

    def count(self, name: str) -> None:
        caller = sys._getframe(2).f_code
        if caller is EpochBatchSampler.__iter__.__code__:
            return  # the epoch's order: a host tensor from a CPU generator, never a device sync
        if self.armed and self.depth == 0:
            where = "".join(traceback.format_stack(limit=6)[:-2])
            self.calls.append(f"Tensor.{name} during a non-logging step:\n{where}")


def _wrap(watch: HostReadWatch, name: str, original):
    @functools.wraps(original)
    def counting(self, *args, **kwargs):
        watch.count(name)
        return original(self, *args, **kwargs)

    return counting


def _paused(watch: HostReadWatch, original):
    @functools.wraps(original)
    def paused(*args, **kwargs):
        with watch.pause():
            return original(*args, **kwargs)

    return paused


def watched_fit(monkeypatch, trainer: Trainer) -> HostReadWatch:
    """Run trainer.fit() with host reads counted (and, on CUDA, syncs raising) between logs.
    torch's GradScaler hands its skip flag to a fused optimizer on the device; an optimizer
    without that support has its flag read on the host by GradScaler's step (counted here)."""
    watch = HostReadWatch(trainer.run.device.type == "cuda")
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, _wrap(watch, name, getattr(torch.Tensor, name)))
    for cls, name in [
        (Trainer, "_train_record"),
        (Trainer, "_eval_record"),
        (ThroughputMeter, "_open"),
    ]:  # _open: the one timing boundary, at warm-up
        monkeypatch.setattr(cls, name, _paused(watch, getattr(cls, name)))
    loop = Trainer._loop

    def armed_loop(self, *args, **kwargs):
        with watch.arm():
            return loop(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_loop", armed_loop)
    trainer.fit()
    return watch
