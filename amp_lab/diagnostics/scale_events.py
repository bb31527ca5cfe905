"""Loss-scale events read from a log window: backoffs, growths, and GradScaler misuse.

Misuse (docs/amp_pitfalls.md §2): skips without a backoff beyond the allowed holds (no update()),
a scale moving more than one factor a step or growing too soon (update() per micro-batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from amp_lab.choices import PitfallName
from amp_lab.config import ScalerConfig
from amp_lab.precision.scaling import allowed_holds

# plain str keys: the tracker's state goes into checkpoints loaded with weights_only=True
NO_UPDATE = PitfallName.no_scaler_update.value
MULTI_UPDATE = PitfallName.update_every_microbatch.value


@dataclass
class ScaleTracker:
    """Host-side history of the loss scale, fed one window at a time."""

    cfg: ScalerConfig
    dynamic: bool  # a dynamic GradScaler: every skip must back off
    scale: float  # the scale before the next window's first step
    events: list[dict] = field(default_factory=list)  # every backoff and growth
    signatures: dict[str, str] = field(default_factory=dict)  # misuse name -> evidence
    last_growth: int | None = None
    held: int = 0  # consecutive skipped steps that kept the scale

    def _check_change(self, step: int, old: float, scale: float) -> None:
        """The signature of update() per micro-batch in one change of the scale."""
        if scale > old:
            last, self.last_growth = self.last_growth, step
            if last is not None and step - last < self.cfg.growth_interval:
                self.signatures.setdefault(
                    MULTI_UPDATE,
                    f"the scale grew at steps {last} and {step}, sooner than "
                    f"scaler.growth_interval={self.cfg.growth_interval} allows",
                )
        allowed = (1.0, self.cfg.growth_factor, self.cfg.backoff_factor)
        if old > 0 and not any(math.isclose(scale / old, r, rel_tol=1e-6) for r in allowed):
            self.signatures.setdefault(
                MULTI_UPDATE,
                f"step {step}: the scale went {old:g} -> {scale:g} in one optimizer "
                "step, more than one growth_factor/backoff_factor",
            )

    def feed(self, first_step: int, scales: list[float], skipped: list[float]) -> list[dict]:
        """Add a window (scale after each step, 1.0 where it skipped); returns its events."""
        window = []
        holds = allowed_holds(self.cfg)
        for step, (scale, skip) in enumerate(zip(scales, skipped), start=first_step):
            old, self.scale = self.scale, scale
            if scale != old:
                kind = "backoff" if scale < old else "growth"
                window.append({"step": step, "kind": kind, "from": old, "to": scale})
                self._check_change(step, old, scale)
            self.held = self.held + 1 if skip and scale == old else 0
            if self.dynamic and self.held > holds:
                self.signatures.setdefault(
                    NO_UPDATE,
                    f"step {step} skipped (inf/nan gradients) but the scale stayed at {scale:g}",
                )
        self.events += window
        return window
