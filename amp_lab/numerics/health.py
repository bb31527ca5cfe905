"""Run health: the silent failures a run names about itself, from what its log steps read anyway.

The runner feeds `RunHealth.observe` once per log window with host values it has already read
(the window's loss mean, finite and skipped counts, the loss scale, the zero-gradient share of a
probe step), so the rules add no device read between log steps. Each rule that fires is a
warning line with its evidence and an entry of `summary.json` -> `health`; the doctor judges its
probes by the same rules (amp_lab/doctor/verdict.py). Thresholds: `diagnostics.health_*`,
their defaults explained in docs/diagnostics.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from amp_lab.config import DiagnosticsConfig

# rule names, shared with the doctor
UNDERFLOW = "underflow"
LOSS_RISES = "loss_rises"
LOSS_STALLS = "loss_stalls"
SKIPS = "skips"
SCALE_COLLAPSE = "scale_collapse"
SCALE_PINNED = "scale_pinned"
FINAL_SKIPPED = "final_window_skipped"
FINAL_NONFINITE = "final_window_nonfinite"


@dataclass
class Window:
    """One log window, as the runner read it."""

    last_step: int
    steps: int
    finite: int  # steps whose loss was finite
    skipped: int  # steps whose update was skipped (non-finite gradients)
    loss: float  # mean of the finite losses (nan if none)
    scale: float  # loss scale after the window


@dataclass
class RunHealth:
    """The health rules over one run's log windows; `entries` is what summary.json holds."""

    cfg: DiagnosticsConfig
    dynamic_scale: bool  # a dynamic loss scaler is meant to adapt the scale
    init_scale: float
    # ln(classes): a fresh classifier's cross-entropy. The first log window's mean can
    # already hold a blown-up loss (log_every=10), so "rises" compares with the lower of the two
    chance_loss: float = math.inf
    windows: list[Window] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)

    # checkpoints written before run health was saved resume with a fresh history
    optional_in_checkpoint = True

    def state_dict(self) -> dict[str, Any]:
        """The windows seen and the findings made (plain data), so a resumed run judges its
        whole history and does not report a finding twice."""
        return {"windows": [asdict(w) for w in self.windows], "entries": list(self.entries)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.windows = [Window(**w) for w in state["windows"]]
        self.entries = [dict(e) for e in state["entries"]]

    def _add(self, rule: str, step: int, evidence: str) -> str | None:
        """Record a finding once per rule; returns its warning line when it is new."""
        if any(e["rule"] == rule for e in self.entries):
            return None
        self.entries.append({"rule": rule, "step": step, "evidence": evidence})
        return f"run health: {rule} at step {step}: {evidence}"

    def observe(self, window: Window, zero_grad_share: float | None) -> list[str]:
        """Feed one log window; returns the warning lines of rules that fired for the first time."""
        self.windows.append(window)
        lines = []
        # a window that skipped says nothing about underflow: its gradients held inf/nan
        if (
            zero_grad_share is not None
            and not window.skipped
            and zero_grad_share >= self.cfg.health_zero_grad_share
        ):
            lines.append(
                self._add(
                    UNDERFLOW,
                    window.last_step,
                    (
                        f"{zero_grad_share:.0%} of gradient elements are exactly zero (>= "
                        "diagnostics.health_zero_grad_share="
                        f"{self.cfg.health_zero_grad_share:g}): they underflowed, so the weights "
                        "they belong to stop learning"
                    ),
                )
            )
        if self.dynamic_scale and window.scale < self.cfg.health_min_scale:
            lines.append(
                self._add(
                    SCALE_COLLAPSE,
                    window.last_step,
                    (
                        f"the loss scale fell to {window.scale:g} (< diagnostics.health_min_scale="
                        f"{self.cfg.health_min_scale:g}, from {self.init_scale:g}): the gradients "
                        "overflow even unscaled"
                    ),
                )
            )
        return [line for line in lines if line]

    def _span(self, windows: list[Window]) -> list[Window]:
        """The fewest windows from the start of `windows` covering health_window steps."""
        taken, steps = [], 0
        for w in windows:
            taken.append(w)
            steps += w.steps
            if steps >= self.cfg.health_window:
                break
        return taken

    def final_window(self) -> tuple[int, int, int]:
        """(steps, finite, skipped) of the last health_window steps (whole log windows)."""
        tail = self._span(self.windows[::-1])
        return (
            sum(w.steps for w in tail),
            sum(w.finite for w in tail),
            sum(w.skipped for w in tail),
        )

    def final_nonfinite(self) -> bool:
        """True when no loss of the final window was finite: the run has diverged."""
        steps, finite, _ = self.final_window()
        return steps > 0 and finite == 0

    def finish(self, steps: int, skipped: int) -> list[str]:
        """The rules over the whole run; returns their warning lines."""
        if not self.windows:
            return []
        cfg, last = self.cfg, self.windows[-1].last_step
        lines = []
        n, finite, skipped_tail = self.final_window()
        if finite == 0:
            lines.append(
                self._add(
                    FINAL_NONFINITE,
                    last,
                    (f"every loss of the last {n} steps is inf/nan: the run diverged"),
                )
            )
        elif skipped_tail == n:
            lines.append(
                self._add(
                    FINAL_SKIPPED,
                    last,
                    (f"all of the last {n} steps skipped their update: the weights no longer move"),
                )
            )
        if skipped >= 2 and skipped / max(1, steps) > cfg.health_skip_rate:
            lines.append(
                self._add(
                    SKIPS,
                    last,
                    (
                        f"{skipped}/{steps} steps skipped ({skipped / max(1, steps):.0%} > "
                        f"diagnostics.health_skip_rate={cfg.health_skip_rate:g}): the run is "
                        "unstable"
                    ),
                )
            )
        scales = {w.scale for w in self.windows}
        if self.dynamic_scale and skipped > 0 and scales == {self.init_scale}:
            lines.append(
                self._add(
                    SCALE_PINNED,
                    last,
                    (
                        f"{skipped} steps skipped yet the loss scale stayed at "
                        f"{self.init_scale:g}: the scaler never adapts (is scaler.update() called?)"
                    ),
                )
            )
        lines += self._trend(steps, last)
        return [line for line in lines if line]

    def _trend(self, steps: int, last: int) -> list[str | None]:
        """Loss rises (any run) or stalls (runs of at least health_min_steps)."""
        finite = [w for w in self.windows if w.finite and math.isfinite(w.loss)]
        head, tail = self._span(finite), self._span(finite[::-1])
        if not head or head[0].last_step >= tail[-1].last_step:  # too short to compare
            return []
        # rises: against the first log window, the loss before training moved much (a loss
        # that shoots up early and stays high is caught); stalls: over health_window steps
        start, first, end = min(head[0].loss, self.chance_loss), _mean(head), _mean(tail)
        cfg = self.cfg
        if end > start * (1 + cfg.health_rise):
            return [
                self._add(
                    LOSS_RISES,
                    last,
                    (
                        f"the loss rose from {start:.4g} to {end:.4g} (> {1 + cfg.health_rise:g}x, "
                        "diagnostics.health_rise): the run does not train; lower the LR, add "
                        "warmup or clipping"
                    ),
                )
            ]
        if (
            steps >= cfg.health_min_steps
            and head[-1].last_step < tail[-1].last_step
            and end > first * (1 - cfg.health_min_drop)
        ):
            return [
                self._add(
                    LOSS_STALLS,
                    last,
                    (
                        f"the loss went from {first:.4g} to {end:.4g} over {steps} steps (fell by "
                        f"less than diagnostics.health_min_drop={cfg.health_min_drop:g}): the run "
                        "does not learn"
                    ),
                )
            ]
        return []

    def summary_line(self) -> str:
        """One console line: the rules that fired, or that none did."""
        if not self.entries:
            return "run health: ok (no silent failure found)"
        return "run health: " + "; ".join(f"{e['rule']} (step {e['step']})" for e in self.entries)


def _mean(windows: list[Window]) -> float:
    """Mean finite loss over windows, weighted by their finite steps."""
    return sum(w.loss * w.finite for w in windows) / sum(w.finite for w in windows)


def rules(summary: dict[str, Any]) -> set[str]:
    """The health rules that fired in a run, read from its summary."""
    return {e["rule"] for e in summary.get("health") or []}
