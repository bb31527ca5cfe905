"""The monitor: one device buffer fed by every step, read at log steps, judged by the rule table.

Each step writes one row (loss, correct, skip, scale, gradient norm) in one op, no host sync; a
log step copies the rows to the host once, and the monitor alone decides whether the run stops.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from typing import Any

import torch
from torch.amp import GradScaler

from amp_lab.components.distributed import DistContext
from amp_lab.config import HealthConfig
from amp_lab.health.rules import DIVERGED, SIGNALS, Finding, History, Window, judge
from amp_lab.precision.scaling import scaler_stop_reason
from amp_lab.step import Rows, StepResult

log = logging.getLogger(__name__)


class Monitor:
    """The run's counters and its health judge; `read()` is the one host read of a log step."""

    TOTALS = ("loss_sum", "loss_count", "correct", "samples")  # summed over the ranks
    WINDOW = (*TOTALS, "skipped")
    COLUMNS = ("loss", "correct", "skip", "scale", "grad_norm")  # a row per step

    def __init__(
        self,
        cfg: HealthConfig,
        device: torch.device,
        log_every: int,
        scaler: GradScaler,
        history: History,
    ) -> None:
        self.cfg, self.device, self.scaler, self.history = cfg, device, scaler, history
        self._allocate_rows(log_every)
        self.pending = 0  # rows written since the last read
        self.samples = 0  # samples since the last read: host ints, no device op
        self.window: dict[str, float] = dict.fromkeys(self.WINDOW, 0.0)
        self.streak = 0  # consecutive skipped steps, carried across windows
        self.findings: list[Finding] = []
        self.figures: dict[str, Any] = {}  # the last read window's spikes (train/ keys)
        self.stop_reason: str | None = None
        self.no_skip = torch.zeros((), device=device)  # a step without a scaler skips nothing
        self.one = torch.ones((), device=device)  # the scale of a step without a scaler

    def _allocate_rows(self, count: int, keep: torch.Tensor | None = None) -> None:
        self.rows = torch.zeros(count, len(self.COLUMNS), device=self.device, dtype=torch.float64)
        if keep is not None:
            self.rows[: len(keep)] = keep
        self.row_views = [list(row.unbind()) for row in self.rows]

    # -- every step --------------------------------------------------------------------------
    def add(self, result: StepResult) -> None:
        """One device op per step: the step's values into the next row."""
        if self.pending == len(self.row_views):  # more steps than a log window: a longer buffer
            self._allocate_rows(2 * len(self.row_views), keep=self.rows)
        skip = result.found_inf if torch.is_tensor(result.found_inf) else self.no_skip
        scale = self.one if result.scale is None else result.scale
        torch._foreach_copy_(
            self.row_views[self.pending],
            [result.loss, result.correct, skip, scale, result.grad_norm],
        )
        self.pending += 1
        self.samples += result.samples

    # -- log steps ---------------------------------------------------------------------------
    def read(self, step: int) -> Rows:
        """Fold the window's rows into the sums (one device-to-host copy) and return them."""
        h, n = self.history, self.pending
        first = step - n + 1
        self.pending = 0
        values = self.rows[:n].tolist() if n else []
        w = self.window
        w["samples"] += self.samples
        self.samples = 0
        for i, (loss, correct, skip, *_) in enumerate(values):
            finite = math.isfinite(loss)
            if finite:  # a nan loss is counted apart, not summed
                w["loss_sum"] += loss
                w["loss_count"] += 1
            w["correct"] += correct
            w["skipped"] += skip
            h.skipped += int(skip)
            self.streak = self.streak + 1 if skip > 0 else 0
            h.worst_streak = max(h.worst_streak, self.streak)
            if h.first_bad is None and (skip > 0 or not finite):
                h.first_bad = first + i
        h.steps = step
        self.figures = self._spikes(first, values)
        losses, _, skips, scales, _ = zip(*values) if values else ((),) * len(self.COLUMNS)
        return Rows(first, list(losses), list(skips), list(scales))

    def _spikes(self, first: int, values: list[list[float]]) -> dict[str, Any]:
        """The window's largest ratio of a step's loss (gradient norm) to the mean of the last
        health.window unskipped steps before it, and its step (as Lightning's SpikeDetection)."""
        figures: dict[str, Any] = {}
        h = self.history
        # below half of chance, ln(classes), a batch's loss varies by factors (up to 4.4x its
        # 10-step mean on digits), so a loss spike is measured against no less than that
        floor = h.chance_loss / 2 if math.isfinite(h.chance_loss) else 0.0
        for name, recent, least in (
            ("loss", h.recent_losses, floor),
            ("grad", h.recent_norms, 0.0),
        ):
            column = self.COLUMNS.index("loss" if name == "loss" else "grad_norm")
            top: tuple[float, int] | None = None
            for i, row in enumerate(values):
                value = row[column]
                if row[2] > 0 or not math.isfinite(value):
                    continue
                if recent:
                    ratio = value / max(sum(recent) / len(recent), least, 1e-30)
                    if top is None or ratio > top[0]:
                        top = (ratio, first + i)
                recent.append(value)
                del recent[: -self.cfg.window]
            if top is not None:
                figures[f"train/{name}_spike"], figures[f"train/{name}_spike_step"] = top
        return figures

    def window_totals(self, dist: DistContext) -> dict[str, float]:
        """The open window's sums, over every rank; the window is then closed."""
        totals = dict(self.window)
        if dist.active:  # the skip counts are equal on every rank: gradients are all-reduced
            local = [totals[k] for k in self.TOTALS]
            summed = dist.all_reduce(torch.tensor(local, dtype=torch.float64, device=self.device))
            totals.update(zip(self.TOTALS, summed.tolist()))
        self.window = dict.fromkeys(self.WINDOW, 0.0)
        return totals

    def judge(
        self, rows: Rows, totals: dict[str, float], world: int, probes: dict[str, Any]
    ) -> list[str]:
        """The window rules on this log window and its `diag/` figures: new findings' lines."""
        h = self.history
        clean_before = rows.first_step - 1 > sum(w.skipped for w in h.windows)
        figures = {**self.figures, **probes}
        h.windows.append(
            Window(
                rows.first_step,
                rows.first_step + len(rows.skips) - 1,
                round(totals["loss_count"] / world),
                int(totals["skipped"]),
                totals["loss_sum"] / totals["loss_count"] if totals["loss_count"] else math.nan,
                rows.scales[-1] if rows.scales else float(self.scaler.get_scale()),
                clean_before,
                probes.get("diag/grad_zero_share"),
                {k: figures[k] for k in SIGNALS if figures.get(k) is not None},
            )
        )
        h.floor = scaler_stop_reason(self.scaler)
        lines = self._judge(at_end=False)
        h.lowest_loss = min(h.lowest_loss, h.tail_loss(self.cfg.window))
        return lines

    def finish(self) -> list[str]:
        """The end rules over the whole run; returns the warning lines of new findings."""
        return self._judge(at_end=True)

    def _judge(self, at_end: bool) -> list[str]:
        """The rules due now that had not fired, recorded; the warning lines of new findings."""
        found = judge(self.history, self.cfg, at_end, {f.rule for f in self.findings})
        self.findings += found
        self.stop_reason = next((f.evidence for f in found if f.rule == DIVERGED), self.stop_reason)
        return [f"run health: {f.evidence} (step {f.step})" for f in found]

    @property
    def diverged(self) -> bool:
        return self.stop_reason is not None

    def summary_line(self) -> str:
        """The console's end line: the findings' words, or that there are none."""
        if not self.findings:
            return "run health: ok (no finding)"
        return "run health: " + "; ".join(f.words for f in self.findings)

    def entries(self) -> list[dict[str, Any]]:
        """summary.json's `health`."""
        return [asdict(f) for f in self.findings]

    # -- checkpoints: the history so far, so a resumed run judges its whole run once ----------
    # a checkpoint written before the monitor (counters and health apart) resumes with a fresh one
    optional_in_checkpoint = True

    def state_dict(self) -> dict[str, Any]:
        """The open window's rows, the history and the findings (tensors and plain data)."""
        return {
            "rows": self.rows[: self.pending].cpu(),
            "samples": self.samples,
            "window": dict(self.window),
            "streak": self.streak,
            "history": self.history.state_dict(),
            "findings": self.entries(),
            "stop_reason": self.stop_reason,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = state["rows"]
        self._allocate_rows(max(len(rows), len(self.row_views)), keep=rows.to(self.device))
        self.pending, self.samples = len(rows), state["samples"]
        self.window, self.streak = dict(state["window"]), state["streak"]
        self.history.load_state_dict(state["history"])
        self.findings = [Finding(**f) for f in state["findings"]]
        self.stop_reason = state["stop_reason"]
