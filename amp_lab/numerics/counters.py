"""The run's loss, accuracy and skip counters: one device op per step, summed at log steps.

Each step writes its loss, correct count and skip flag into one row of a device buffer: a single
op (`torch._foreach_copy_`), nothing to reduce. At a log step (or before a checkpoint), where the
host reads the counters anyway, the rows come to the host in one copy and are summed there: the
non-finite filter and the streak of consecutive skipped steps are a few float additions on the
host, where on a CPU device each of the dozen small tensor ops they took cost ~15 us. Every op a
step launches costs host time, and a short GPU step waits on the host.
"""

from __future__ import annotations

import math

import torch

from amp_lab.step import StepResult


class DeviceCounters:
    """The run's sums (host floats) and the steps since the last read (device rows);
    `read_window()` is the one host sync of a log step."""

    NAMES = (
        "loss_sum",
        "loss_count",
        "correct",
        "samples",
        "skipped",
        "window_skipped",
        "streak",
        "worst_streak",
    )
    WINDOW = ("loss_sum", "loss_count", "correct", "samples", "window_skipped", "worst_streak")

    def __init__(self, device: torch.device, log_every: int) -> None:
        self.device = device
        self.totals = dict.fromkeys(self.NAMES, 0.0)  # folded in from the rows at each read
        # one row per step since the last fold: loss, correct, skip flag
        self._allocate_rows(log_every)
        self.pending = 0  # rows written since the last fold
        self.samples = 0  # samples since the last fold: host ints, no device op
        self.no_skip = torch.zeros((), device=device)  # a step without a scaler skips nothing

    def _allocate_rows(self, count: int, keep: torch.Tensor | None = None) -> None:
        rows = torch.zeros(count, 3, device=self.device, dtype=torch.float64)
        if keep is not None:
            rows[: len(keep)] = keep
        self.rows = rows
        self.row_views = [list(row.unbind()) for row in rows]

    def add(self, result: StepResult) -> None:
        """One device op per step: the step's values into the next row."""
        if self.pending == len(self.row_views):  # more steps than a log window: a longer buffer
            self._allocate_rows(2 * len(self.row_views), keep=self.rows)
        skip = result.found_inf if torch.is_tensor(result.found_inf) else self.no_skip
        torch._foreach_copy_(self.row_views[self.pending], [result.loss, result.correct, skip])
        self.pending += 1
        self.samples += result.samples

    def fold(self) -> None:
        """Add the pending rows to the sums (one device-to-host copy: call at reads only)."""
        n, self.pending = self.pending, 0
        t = self.totals
        t["samples"] += self.samples
        self.samples = 0
        if n == 0:
            return
        for loss, correct, skip in self.rows[:n].tolist():
            if math.isfinite(loss):  # a nan loss is counted apart, not summed
                t["loss_sum"] += loss
                t["loss_count"] += 1
            t["correct"] += correct
            t["skipped"] += skip
            t["window_skipped"] += skip
            # consecutive skipped steps, carried across windows until a clean step
            t["streak"] = t["streak"] + 1 if skip > 0 else 0.0
            t["worst_streak"] = max(t["worst_streak"], t["streak"])

    def reduce(self, dist) -> None:
        """Sum the per-rank counters (the first four). The skip counters are already equal on
        every rank: gradients are all-reduced before the scaler checks them."""
        self.fold()
        if dist.active:
            first = self.NAMES[:4]
            local = [self.totals[k] for k in first]
            summed = dist.all_reduce(torch.tensor(local, dtype=torch.float64, device=self.device))
            self.totals.update(zip(first, summed.tolist()))

    def read_window(self) -> dict[str, float]:
        """All counters; the per-window ones are reset afterwards."""
        self.fold()
        values = dict(self.totals)
        for name in self.WINDOW:
            self.totals[name] = 0.0
        return values

    def state_dict(self) -> torch.Tensor:
        """The counters as one tensor in NAMES order (the checkpoint layout), the pending rows
        folded in."""
        self.fold()
        return torch.tensor([self.totals[k] for k in self.NAMES], dtype=torch.float64)

    def load_state_dict(self, values: torch.Tensor) -> None:
        self.totals = dict(zip(self.NAMES, values.double().tolist()))
        self.pending, self.samples = 0, 0
