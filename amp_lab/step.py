"""The training step — the GradScaler recipe users get wrong, done right once — and evaluation.

One method per stage (STAGES), in the order of docs/amp_pitfalls.md §2: zero_grad -> per
micro-batch autocast forward, fp32 loss / grad_accum, scale(loss).backward() -> at the boundary
unscale_, gradient norm, clip -> scaler.step -> scaler.update, once -> schedule step. The pitfall
lab overrides one stage per mistake. Nothing here reads a value back to the host: the gradient
norm of every step stays a device tensor, which the health monitor reads at log steps.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp import GradScaler

from amp_lab.components.fsdp import full_value
from amp_lab.components.loss import loss_fn
from amp_lab.precision.modes import PrecisionPolicy
from amp_lab.precision.scaler_internals import found_inf, scale_tensor

Batch = tuple[torch.Tensor, torch.Tensor]

# The schedule steps on every optimizer step, skipped or not (see lr.py). When the scaler skips
# the very first update of a non-fused optimizer, PyTorch would warn about the call order.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")


@dataclass
class StepResult:
    """One optimizer step's outcome, all device tensors (no host sync)."""

    loss: torch.Tensor  # mean loss over the micro-batches, fp32 unless a pitfall computes it lower
    correct: torch.Tensor  # correctly classified samples
    samples: int
    grad_norm: torch.Tensor  # L2 norm of the unscaled gradients before clipping
    found_inf: torch.Tensor  # 1.0 when the gradients held inf/nan and the update was skipped
    scale: torch.Tensor | None = None  # the loss scale after the step (None: no scaler used)


@dataclass(frozen=True)
class Rows:
    """The steps of one log window as the monitor read them to the host, in step order."""

    first_step: int
    losses: list[float]
    skips: list[float]  # 1.0 where the step skipped its update
    scales: list[float]  # the loss scale after each step


@dataclass(frozen=True)
class StepView:
    """What a step shows the numerics that watch it (amp_lab/diagnostics/observer.py): the
    watched model and its gradients, the scale, the clip settings and the weights the optimizer
    updates; the step number comes with each `begin_step`."""

    device: torch.device
    model: torch.nn.Module  # the module the step runs (compiled or DDP-wrapped as built)
    optimizer: torch.optim.Optimizer  # its state must stay fp32
    clip_grad: float
    clip_mode: str
    uses_scaler: bool  # False: the step scales nothing, its scale means nothing
    scaler: GradScaler = field(repr=False)
    masters: bool = False  # the optimizer updates fp32 masters of 16-bit weights
    checks_weights: bool = True  # the weights the optimizer updates must be fp32
    # no masters: how the optimizer's fp32 step is rounded into the 16-bit weights
    rounding: str = "nearest"

    def scale(self) -> torch.Tensor:
        """The loss scale as a device tensor (no sync); 1 before the scaler's first scale()."""
        scale = scale_tensor(self.scaler)
        return torch.ones((), device=self.device) if scale is None else scale

    def host_scale(self) -> float:
        """The scale before the next step, read to the host (at start-up or resume only)."""
        return float(self.scaler.get_scale()) if self.uses_scaler else 1.0

    def optimized_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The named tensors the optimizer updates, if they must be fp32: the model's weights,
        or in the pure modes the fp32 masters (read now: the masters replace the model's
        weights in the optimizer's param groups when the precision is prepared)."""
        if not self.checks_weights:
            return []
        if self.masters:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            return [(f"master weight {i}", p) for i, p in enumerate(params)]
        return list(self.model.named_parameters())


class StepObserver:
    """Does nothing; amp_lab/diagnostics/observer.py overrides these to watch a step's numerics.
    The Trainer reads it at log steps, checkpoints it and puts its summary in summary.json."""

    def begin_step(self, step: int) -> None:
        """Before the forward pass of optimizer step `step` (1-based)."""

    def forward_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module this step's forward passes run through: `model` unless told otherwise."""
        return model

    def before_optimizer_step(self) -> None:
        """Gradients unscaled and clipped, weights not yet updated."""

    def end_step(self, result: StepResult) -> None:
        """After the update, the scale update and the schedule step."""

    def read(self, step: int, rows: Rows, first_bad: int | None) -> dict[str, Any]:
        """The record's telemetry at a log step, given the window's rows and the run's first
        non-finite step (amp_lab/health/monitor.py reads both)."""
        return {}

    def summary(self, first_bad: int | None) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


def count_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Correctly classified samples, a device tensor. max().indices is argmax (the first
    maximum); argmax itself has no vectorised CPU kernel for bf16/fp16 and costs 4x as much.
    Soft (mixup) targets count against their largest class."""
    if labels.is_floating_point():
        labels = labels.max(-1).indices
    return (logits.detach().max(-1).indices == labels).sum()


# The stages of a step, in call order; the pitfall lab overrides one at a time and the
# throughput bench times them through `watching_stages`.
STAGES = (
    "forward_and_loss",
    "backward",
    "after_micro_batch",
    "unscale_and_clip",
    "optimizer_step",
    "update_scale",
)


@dataclass
class TrainStep:
    """One optimizer step, written once as named stages (see STAGES)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: GradScaler
    policy: PrecisionPolicy
    # from policy.prepare(), which must run first: the pure modes swap fp32 masters into the
    # optimizer's param groups, which the step captures; pure modes copy grads in with it
    before_unscale: Callable[[], None]
    clip_grad: float = 0.0
    clip_mode: str = "norm"
    micro_batch_context: Callable[[bool], contextlib.AbstractContextManager] = lambda is_last: (
        contextlib.nullcontext()
    )  # DDP's no_sync() until the boundary
    # builds the numerics observer from the step's view, once, when the step is built
    observe: Callable[[StepView], StepObserver] = lambda view: StepObserver()
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn  # fp32 training loss

    uses_scaler = True  # pitfalls.HalfModel drops the scaler: its scale then means nothing
    loss_dtype = torch.float32  # pitfalls.LossInLowPrecision computes the loss in 16 bits

    def __post_init__(self) -> None:
        # the tensors the optimizer steps: the model's, or their fp32 masters in the pure modes
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None  # see __call__
        self.step_number = 0  # the last optimizer step run, 1-based
        self.diagnostics = self.observe(self.view())

    def view(self) -> StepView:
        """What this step shows its observer."""
        mode, options = self.policy.mode, self.policy.options
        low_weights = mode.param_dtype != torch.float32
        return StepView(
            self.policy.device,
            self.model,
            self.optimizer,
            self.clip_grad,
            self.clip_mode,
            self.uses_scaler,
            self.scaler,
            masters=low_weights and options.master_weights,
            # without masters, the bf16 weights are what bf16_pure studies
            checks_weights=not low_weights or options.master_weights,
            rounding=options.update_rounding,
        )

    def __call__(self, micro_batches: Sequence[Batch], step: int | None = None) -> StepResult:
        """Optimizer step `step` (the loop passes it; default: the one after the last)."""
        self.step_number = self.step_number + 1 if step is None else step
        self.diagnostics.begin_step(self.step_number)
        model = self.diagnostics.forward_module(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        losses, corrects, samples, count = [], [], 0, len(micro_batches)
        for i, (images, labels) in enumerate(micro_batches):
            last = i == count - 1
            with self.micro_batch_context(last):
                logits, loss = self.forward_and_loss(model, images, labels, count, last)
                # The previous logits and loss (with its spent graph) are freed here, as a
                # hand-written loop frees them by reassigning its variables. Freed at return
                # instead, they moved the next step's tensors in the CPU heap, and test_vit's
                # steps ran ~2% slower (docs/benchmarks.md).
                self.held = (logits, loss)
                self.backward(loss)
            self.after_micro_batch(last)
            losses.append(loss.detach())
            corrects.append(count_correct(logits, labels))
            samples += labels.shape[0]
        # one micro-batch (the common case) adds no op: its loss and count are the step's
        loss_sum = losses[0] if count == 1 else torch.stack(losses).sum()
        correct = corrects[0] if count == 1 else torch.stack(corrects).sum()
        grad_norm = self.unscale_and_clip()
        self.diagnostics.before_optimizer_step()
        skipped = self.optimizer_step(grad_norm)
        self.update_scale()
        self.scheduler.step()
        scale = scale_tensor(self.scaler) if self.uses_scaler else None
        result = StepResult(loss_sum, correct, samples, grad_norm, skipped, scale)
        self.diagnostics.end_step(result)
        return result

    # -- the stages ----------------------------------------------------------------------------
    def forward_and_loss(
        self,
        model: torch.nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        micro_batches: int,
        last: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The autocast forward pass and this micro-batch's share of the loss."""
        with self.policy.autocast():
            logits = model(images)
        loss = self.compute_loss(logits, labels)
        # dividing by the number of micro-batches makes accumulation an average (by 1: no op)
        return logits, loss / micro_batches if micro_batches > 1 else loss

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(logits, labels)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def after_micro_batch(self, last: bool) -> None:
        """Nothing between micro-batches: the scaler acts once, at the boundary."""

    def unscale_and_clip(self) -> torch.Tensor:
        """Unscale first, so the norm and the clip threshold see the true gradients."""
        self.before_unscale()
        self.scaler.unscale_(self.optimizer)
        return self.norm_and_clip()

    def norm_and_clip(self) -> torch.Tensor:
        """The total gradient norm (before clipping), then clip by norm or value if asked."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if self.clip_grad > 0 and self.clip_mode == "norm":
            torch.nn.utils.clip_grads_with_norm_(self.params, self.clip_grad, norm, foreach=True)
        elif self.clip_grad > 0:
            torch.nn.utils.clip_grad_value_(self.params, self.clip_grad, foreach=True)
        # FSDP: a norm over gradient shards is a DTensor; the total across them is read here
        return full_value(norm).float()

    def optimizer_step(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """The update, skipped when the gradients hold inf/nan; returns that skip flag."""
        self.scaler.step(self.optimizer)
        return found_inf(self.scaler, self.optimizer)  # before update() clears it

    def update_scale(self) -> None:
        self.scaler.update()  # once per optimizer step

    @contextlib.contextmanager
    def watching_stages(self, after_stage: Callable[[str], None]) -> Iterator[None]:
        """Call `after_stage(name)` each time a stage returns; the stages run as they are."""
        for name in STAGES:
            setattr(self, name, _then(getattr(self, name), functools.partial(after_stage, name)))
        try:
            yield
        finally:
            for name in STAGES:
                delattr(self, name)  # the class's own stages again


def _then(stage: Callable[..., Any], after: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(stage)
    def run(*args: Any, **kwargs: Any) -> Any:
        out = stage(*args, **kwargs)
        after()
        return out

    return run


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: Iterable[Batch], policy: PrecisionPolicy
) -> dict[str, float]:
    """Mean val loss and accuracy under the run's own autocast policy."""
    model.eval()
    loss_sum = torch.zeros((), device=policy.device)
    correct = torch.zeros((), device=policy.device, dtype=torch.long)
    count = 0
    for images, labels in batches:
        with policy.autocast():
            logits = model(images)
        loss_sum += loss_fn(logits, labels) * labels.shape[0]
        correct += count_correct(logits, labels)
        count += labels.shape[0]
    model.train()
    return {"val/loss": loss_sum.item() / count, "val/acc": correct.item() / count}


def take(iterator: Iterator[Batch], n: int) -> list[Batch]:
    """The next n micro-batches (fewer at the end of an epoch)."""
    return list(itertools.islice(iterator, n))
