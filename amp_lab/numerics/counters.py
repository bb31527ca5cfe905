"""The run's loss, accuracy and skip counters, kept on the device and read at log steps only.

Each step writes its loss, correct count and skip flag into one row of a window buffer: a single
op (`torch._foreach_copy_`), nothing to reduce. The sums, the non-finite filter and the streak of
consecutive skipped steps are computed from the rows at a log step (or before a checkpoint),
where the host reads the counters anyway. Every op a step launches costs host time, and a short
GPU step waits on the host.
"""

from __future__ import annotations

import torch

from amp_lab.step import StepResult


class DeviceCounters:
    """Running sums kept on the device; `read_window()` is the one host sync of a log step."""

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
        # the checkpointed counters, in NAMES order (the layout checkpoints hold)
        self.values = torch.zeros(len(self.NAMES), device=device, dtype=torch.float64)
        self.views = dict(zip(self.NAMES, self.values.unbind()))
        # one row per step since the last fold: loss, correct, skip flag
        self.rows = torch.zeros(log_every, 3, device=device, dtype=torch.float64)
        self.row_views = [list(row.unbind()) for row in self.rows]
        self.pending = 0  # rows written since the last fold
        self.samples = 0  # samples since the last fold: host ints, no device op
        self.no_skip = torch.zeros((), device=device)  # a step without a scaler skips nothing

    def add(self, result: StepResult) -> None:
        """One device op per step: the step's values into the next row."""
        if self.pending == len(self.row_views):  # more steps than a log window: fold early
            self.fold()
        skip = result.found_inf if torch.is_tensor(result.found_inf) else self.no_skip
        torch._foreach_copy_(self.row_views[self.pending], [result.loss, result.correct, skip])
        self.pending += 1
        self.samples += result.samples

    def fold(self) -> None:
        """Add the pending rows to the counters (device ops, no sync)."""
        n, self.pending = self.pending, 0
        samples, self.samples = self.samples, 0
        if n == 0:
            return
        loss, correct, skip = self.rows[:n].unbind(1)
        finite = torch.isfinite(loss)  # a nan loss is counted apart, not summed
        v = self.views
        skips = skip.sum()
        torch._foreach_add_(
            [v["loss_sum"], v["loss_count"], v["correct"], v["skipped"], v["window_skipped"]],
            [torch.where(finite, loss, 0.0).sum(), finite.sum(), correct.sum(), skips, skips],
        )
        v["samples"].add_(samples)
        # consecutive skipped steps: the steps since the last clean one, plus the streak carried
        # in while no clean step has come yet in these rows
        index = torch.arange(n, device=skip.device, dtype=skip.dtype)
        last_clean = torch.where(skip > 0, -1.0, index).cummax(0).values
        streaks = index - last_clean + torch.where(last_clean < 0, v["streak"], 0.0)
        v["streak"].copy_(streaks[-1])
        torch.maximum(v["worst_streak"], streaks.max(), out=v["worst_streak"])

    def reduce(self, dist) -> None:
        """Sum the per-rank counters (the first four). The skip counters are already equal on
        every rank: gradients are all-reduced before the scaler checks them."""
        self.fold()
        dist.all_reduce(self.values[:4])

    def read_window(self) -> dict[str, float]:
        """Host copy of all counters; the per-window ones are reset afterwards."""
        self.fold()
        values = dict(zip(self.NAMES, self.values.tolist()))
        for name in self.WINDOW:
            self.views[name].zero_()
        return values

    def state_dict(self) -> torch.Tensor:
        """The counters as one tensor (the checkpoint layout), the pending rows folded in."""
        self.fold()
        return self.values

    def load_state_dict(self, values: torch.Tensor) -> None:
        self.values.copy_(values)
        self.pending, self.samples = 0, 0
