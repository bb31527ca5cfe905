"""The pitfall lab: classic AMP mistakes (`pitfall=`) and numerical faults (`fault.*`), on purpose.

Each variant overrides one stage of the correct TrainStep (amp_lab/step.py), so every mistake is
a few lines that read next to the right way (docs/amp_pitfalls.md §2-3).
"""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from amp_lab.choices import PitfallName
from amp_lab.config import ConfigError, FaultConfig
from amp_lab.precision.modes import PrecisionPolicy
from amp_lab.precision.scaler_internals import scale_tensor, update_scale_now
from amp_lab.step import TrainStep


def _inputs_to_fp16(module: torch.nn.Module, args: tuple) -> tuple:
    return tuple(a.half() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def prepare_model(
    model: torch.nn.Module, fault: FaultConfig, pitfall: str, policy: PrecisionPolicy
) -> None:
    """Model-side faults: scale one module's output; `half_model` casts weights to fp16."""
    if pitfall == PitfallName.half_model:
        _check_half_model(policy)
    if fault.overflow_module:
        modules = dict(model.named_modules())
        if fault.overflow_module not in modules:
            close = difflib.get_close_matches(fault.overflow_module, modules, n=3, cutoff=0.5)
            raise ConfigError(
                f"fault.overflow_module={fault.overflow_module!r} is not a module "
                f"of the model; did you mean {', '.join(close) or '?'}"
            )
        factor = fault.overflow_factor
        # in the module's own dtype: fp16 passes 65504 and turns inf
        modules[fault.overflow_module].register_forward_hook(lambda m, args, out: out * factor)
    if pitfall == PitfallName.half_model:
        model.half()  # the mistake: the optimizer built next keeps fp16 weights and fp16 state
        model.register_forward_pre_hook(_inputs_to_fp16)


def _check_half_model(policy: PrecisionPolicy) -> None:
    """model.half() beside bf16 (or precision.fp32_modules) shows no mistake, only a cast back
    or a dtype error in timm's layers (tests/diagnostics/test_pitfall_claims.py)."""
    if kept := policy.options.fp32_modules:
        raise ConfigError(
            f"precision.fp32_modules=[{','.join(kept)}] cannot run in fp32 over model.half()'s "
            "fp16 weights (pitfall=half_model); drop one of the two"
        )
    mode = policy.mode
    if mode.param_dtype == torch.bfloat16:
        happens = "casts every weight to bf16 itself, which undoes model.half()"
    elif mode.autocast_dtype == torch.bfloat16 and policy.device.type == "cpu":
        happens = "on the CPU feeds the fp16 weights bf16 activations, which timm's layers refuse"
    else:
        return
    raise ConfigError(
        f"pitfall=half_model is model.half() beside fp16 or fp32 compute; precision={mode.name} "
        f"{happens}; use precision=fp16 (or another mode without bf16)"
    )


@dataclass
class LabStep(TrainStep):
    """The correct step plus the faults of `fault.*`; each pitfall below overrides one stage."""

    fault: FaultConfig = field(default_factory=FaultConfig)

    def forward_and_loss(
        self,
        model: torch.nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        micro_batches: int,
        last: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, loss = super().forward_and_loss(model, images, labels, micro_batches, last)
        if last and self.step_number == self.fault.inf_grad_at_step:
            logits.register_hook(lambda g: g * math.inf)  # the injected inf gradient
        if last and self.step_number == self.fault.grad_spike_at_step:
            logits.register_hook(lambda g: g * self.fault.grad_spike_factor)
        return logits, loss

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return super().compute_loss(logits, labels) * self.fault.loss_multiplier


class NoScalerUpdate(LabStep):
    """update() forgotten: the scale never backs off, so an overflowing run skips every step."""

    def update_scale(self) -> None:
        scale = scale_tensor(self.scaler)
        self.scaler.update(None if scale is None else scale.clone())  # same scale, state reset


class UpdateEveryMicrobatch(LabStep):
    """The scale is updated after every micro-batch: it grows grad_accum times too fast, and the
    micro-batches of one step are scaled differently but unscaled by one (the last) scale."""

    def after_micro_batch(self, last: bool) -> None:
        if last:
            return  # the regular update() follows scaler.step()
        # the inf check update() relies on, on the gradients so far
        update_scale_now(self.scaler, [p.grad for p in self.params if p.grad is not None])


class ClipBeforeUnscale(LabStep):
    """The clip acts on scaled gradients, then they are unscaled: about 1/scale of the intended
    gradient, which crawls under SGD; AdamW normalises it away (test_pitfall_claims.py)."""

    def unscale_and_clip(self) -> torch.Tensor:
        self.before_unscale()
        norm = self.norm_and_clip()  # on the scaled gradients: the mistake
        self.scaler.unscale_(self.optimizer)
        return norm  # the scaled norm, which is what such a loop logs


class HalfModel(LabStep):
    """Weights and optimizer state in fp16 (model.half()), and no scaler (it refuses fp16
    gradients): small updates round away, and inf/nan gradients reach the weights."""

    uses_scaler = False

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_and_clip(self) -> torch.Tensor:
        """Nothing to unscale; the norm is the only inf/nan check."""
        return self.norm_and_clip()

    def optimizer_step(self, grad_norm: torch.Tensor) -> torch.Tensor:
        self.optimizer.step()  # no skip: a non-finite gradient reaches the weights
        return (~torch.isfinite(grad_norm)).float()

    def update_scale(self) -> None:
        """No scaler."""


class LossInLowPrecision(LabStep):
    """The loss is computed from fp16 logits in fp16: its resolution is coarse (10 mantissa
    bits), and the backward enters it with the loss scale in fp16, where 65536 is already inf."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.loss_dtype = self.policy.mode.autocast_dtype or torch.float32

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.policy.device.type, enabled=False):  # no fp32 promotion
            return F.cross_entropy(logits.to(self.loss_dtype), labels) * self.fault.loss_multiplier


VARIANTS: dict[PitfallName, type[LabStep]] = {
    PitfallName.none: LabStep,
    PitfallName.no_scaler_update: NoScalerUpdate,
    PitfallName.update_every_microbatch: UpdateEveryMicrobatch,
    PitfallName.clip_before_unscale: ClipBeforeUnscale,
    PitfallName.half_model: HalfModel,
    PitfallName.loss_in_low_precision: LossInLowPrecision,
}


def step_class(pitfall: str, fault: FaultConfig) -> Callable[..., TrainStep]:
    """What builds the run's step: the correct TrainStep, or the pitfall's variant with faults."""
    if pitfall == PitfallName.none and fault == FaultConfig():
        return TrainStep
    return functools.partial(VARIANTS[PitfallName(pitfall)], fault=fault)
