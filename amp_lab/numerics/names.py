"""The pitfall names, shared by the pitfall lab (the mistakes it makes on purpose) and the
diagnostics (the signatures they report): one name per mistake, in configs, records and JSON.

A StrEnum, so a member equals its string (`Pitfall.HALF_MODEL == "half_model"`) and JSON writes
the plain string; the doctor and the report keep comparing with strings.
"""

from __future__ import annotations

from enum import StrEnum


class Pitfall(StrEnum):
    """A classic AMP mistake (docs/amp_pitfalls.md §2-3); `NONE` is the correct recipe."""

    NONE = "none"
    NO_SCALER_UPDATE = "no_scaler_update"  # update() forgotten: the scale never moves
    UPDATE_EVERY_MICROBATCH = "update_every_microbatch"  # update() per micro-batch
    CLIP_BEFORE_UNSCALE = "clip_before_unscale"  # the clip acts on scaled gradients
    HALF_MODEL = "half_model"  # weights and optimizer state in fp16
    LOSS_IN_LOW_PRECISION = "loss_in_low_precision"  # the loss computed in fp16
