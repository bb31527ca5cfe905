"""The pitfall lab: classic AMP mistakes and numerical faults, reproduced on purpose.

`pitfall=` swaps the correct TrainStep (amp_lab/step.py, left untouched) for a variant that makes
one mistake of docs/amp_pitfalls.md §2-3; `fault.*` injects a numerical fault. LabStep
restates the correct recipe with one method per stage, and each variant overrides one stage, so
every mistake is a few lines that read next to the right way.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from amp_lab.config import ConfigError, FaultConfig
from amp_lab.precision.scaling import skipped_update
from amp_lab.step import Batch, StepResult, TrainStep, count_correct


def _scale_output(factor: float):
    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        return output * factor  # in the module's own dtype: fp16 passes 65504 and turns inf

    return hook


def _cast_inputs_to(dtype: torch.dtype):
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                     for a in args)

    return hook


def prepare_model(model: torch.nn.Module, fault: FaultConfig, pitfall: str) -> None:
    """Model-side faults: scale one module's output; `half_model` casts weights to fp16."""
    if fault.overflow_module:
        modules = dict(model.named_modules())
        if fault.overflow_module not in modules:
            close = difflib.get_close_matches(fault.overflow_module, modules, n=3, cutoff=0.5)
            raise ConfigError(f"fault.overflow_module={fault.overflow_module!r} is not a module "
                              f"of the model; did you mean {', '.join(close) or '?'}")
        modules[fault.overflow_module].register_forward_hook(
            _scale_output(fault.overflow_factor))
    if pitfall == "half_model":
        model.half()  # the mistake: the optimizer built next keeps fp16 weights and fp16 state
        model.register_forward_pre_hook(_cast_inputs_to(torch.float16))


@dataclass
class LabStep(TrainStep):
    """The correct recipe, one method per stage, plus the faults of `fault.*`."""

    fault: FaultConfig = field(default_factory=FaultConfig)

    def __call__(self, micro_batches: Sequence[Batch], measure_norm: bool = True) -> StepResult:
        self.diagnostics.begin_step()
        model = self.diagnostics.forward_module(self.model)
        step = self.scheduler.last_epoch + 1  # this optimizer step, 1-based, known on the host
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = None  # keeps the loss's own dtype (fp16 for loss_in_low_precision)
        correct = torch.zeros((), device=self.policy.device, dtype=torch.long)
        samples = 0
        for i, (images, labels) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with self.micro_batch_context(last):
                with self.policy.autocast():
                    logits = model(images)
                loss = self.compute_loss(logits, labels) / len(micro_batches)
                if last and step == self.fault.inf_grad_at_step:
                    logits.register_hook(lambda g: g * math.inf)  # the injected inf gradient
                self.backward(loss)
            self.after_micro_batch(last)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            correct += count_correct(logits, labels)
            samples += labels.shape[0]
        grad_norm = self.unscale_and_clip(measure_norm)
        self.diagnostics.before_optimizer_step()
        found_inf = self.optimizer_step(grad_norm)
        self.update_scale()
        self.scheduler.step()
        result = StepResult(loss_sum, correct, samples, grad_norm, found_inf)
        self.diagnostics.end_step(result)
        return result

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(logits, labels) * self.fault.loss_multiplier

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def after_micro_batch(self, last: bool) -> None:
        """Nothing between micro-batches: the scaler acts once, at the boundary."""

    def optimizer_step(self, grad_norm: torch.Tensor | None) -> torch.Tensor:
        self.scaler.step(self.optimizer)  # skips the update when the gradients hold inf/nan
        return skipped_update(self.scaler, self.optimizer)

    def update_scale(self) -> None:
        self.scaler.update()


class NoScalerUpdate(LabStep):
    """update() forgotten: the scale never backs off, so an overflowing run skips every step.

    torch's GradScaler refuses a second step() without update(); this variant resets that
    bookkeeping but never adapts the scale, which is what a loop with a fixed scale does.
    """

    def update_scale(self) -> None:
        self.scaler.update(self.scaler._get_scale_async().clone())  # same scale, state reset


class UpdateEveryMicrobatch(LabStep):
    """The scale is updated after every micro-batch: it grows grad_accum times too fast, and the
    micro-batches of one step are scaled differently but unscaled by one (the last) scale."""

    def after_micro_batch(self, last: bool) -> None:
        if last:
            return  # the regular update() follows scaler.step()
        grads = [p.grad for p in self.params if p.grad is not None]
        found_inf = torch.zeros((), device=self.policy.device)
        if grads:  # the inf check update() relies on, on the gradients so far (inv_scale 1)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_inf, torch.ones((), device=self.policy.device))
        s = self.scaler
        torch._amp_update_scale_(s._scale, s._growth_tracker, found_inf, s._growth_factor,
                                 s._backoff_factor, s._growth_interval)


class ClipBeforeUnscale(LabStep):
    """The clip threshold is applied to scaled gradients, then they are unscaled: the update is
    about 1/scale of the intended one, and training crawls."""

    def unscale_and_clip(self, measure_norm: bool = True) -> torch.Tensor | None:
        norm = self.norm_and_clip(measure_norm)  # on the scaled gradients: the mistake
        self.scaler.unscale_(self.optimizer)
        return norm  # the scaled norm, which is what such a loop logs


class HalfModel(LabStep):
    """Weights and optimizer state in fp16 (model.half()). GradScaler refuses fp16 gradients, so,
    like a user who hit that error, this loop drops the scaler: small updates round away
    against fp16 weights, and inf/nan gradients are written into the weights."""

    uses_scaler = False

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_and_clip(self, measure_norm: bool = True) -> torch.Tensor:
        """The norm on every step: without a scaler it is the only inf/nan check."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if self.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.clip_grad, norm, foreach=True)
        return norm.float()

    def optimizer_step(self, grad_norm: torch.Tensor) -> torch.Tensor:
        self.optimizer.step()  # no skip: a non-finite gradient reaches the weights
        return (~torch.isfinite(grad_norm)).float()

    def update_scale(self) -> None:
        """No scaler."""


class LossInLowPrecision(LabStep):
    """The loss is computed from fp16 logits in fp16: its resolution is coarse (10 mantissa
    bits), and the backward enters it with the loss scale in fp16, where 65536 is already inf."""

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        dtype = self.policy.mode.autocast_dtype or torch.float32
        with torch.autocast(self.policy.device.type, enabled=False):  # no fp32 promotion
            return F.cross_entropy(logits.to(dtype), labels) * self.fault.loss_multiplier


VARIANTS: dict[str, type[LabStep]] = {
    "none": LabStep, "no_scaler_update": NoScalerUpdate,
    "update_every_microbatch": UpdateEveryMicrobatch, "clip_before_unscale": ClipBeforeUnscale,
    "half_model": HalfModel, "loss_in_low_precision": LossInLowPrecision,
}


def make_step(step: TrainStep, pitfall: str, fault: FaultConfig) -> TrainStep:
    """The correct step itself, or the pitfall's variant built from the same parts."""
    if pitfall == "none" and fault == FaultConfig():
        return step
    parts = {f.name: getattr(step, f.name) for f in fields(step)}
    return VARIANTS[pitfall](**parts, fault=fault)
