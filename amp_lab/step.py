"""The training step — the GradScaler recipe users get wrong, done right once — and evaluation.

Order per optimizer step (docs/amp_pitfalls.md §2):
zero_grad(set_to_none) -> for each micro-batch: autocast forward -> fp32 loss / grad_accum ->
scale(loss).backward() -> at the boundary only: unscale_ -> gradient norm -> clip -> scaler.step
-> scaler.update (once per optimizer step) -> schedule step.
Nothing here reads a value back to the host: the results are device tensors. The gradient norm
is computed only when something uses it (a log step, clipping by norm): every op the step
launches costs host time, and a short GPU step waits on the host.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.amp import GradScaler

from amp_lab.precision.modes import PrecisionPolicy
from amp_lab.precision.scaling import skipped_update

Batch = tuple[torch.Tensor, torch.Tensor]

# The schedule steps on every optimizer step, skipped or not (see lr.py). When the scaler skips
# the very first update of a non-fused optimizer, PyTorch would warn about the call order.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")


@dataclass
class StepResult:
    """One optimizer step's outcome, all device tensors (no host sync)."""

    loss: torch.Tensor  # mean fp32 loss over the micro-batches
    correct: torch.Tensor  # correctly classified samples
    samples: int
    grad_norm: torch.Tensor | None  # L2 norm of the unscaled gradients before clipping; None
    # when the step was asked for no norm and did not clip by norm
    found_inf: torch.Tensor  # 1.0 when the gradients held inf/nan and the update was skipped


class StepObserver:
    """Does nothing; amp_lab/diagnostics.py overrides these to watch the numerics of a step."""

    def begin_step(self) -> None:
        """Before the forward pass."""

    def forward_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module this step's forward passes run through: `model` unless told otherwise."""
        return model

    def before_optimizer_step(self) -> None:
        """Gradients unscaled and clipped, weights not yet updated."""

    def end_step(self, result: StepResult) -> None:
        """After the update, the scale update and the schedule step."""


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # The loss runs in fp32: log-softmax over fp16 logits loses the small probabilities.
    return F.cross_entropy(logits.float(), labels)


def count_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Correctly classified samples, a device tensor. max().indices is argmax (the first
    maximum); argmax itself has no vectorised CPU kernel for bf16/fp16 and costs 4x as much.
    Soft (mixup) targets count against their largest class."""
    if labels.is_floating_point():
        labels = labels.max(-1).indices
    return (logits.detach().max(-1).indices == labels).sum()


@dataclass
class TrainStep:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: GradScaler
    policy: PrecisionPolicy
    clip_grad: float = 0.0
    clip_mode: str = "norm"
    channels_last: bool = False
    micro_batch_context: Callable[[bool], contextlib.AbstractContextManager] = (
        lambda is_last: contextlib.nullcontext())  # DDP's no_sync() until the boundary
    before_unscale: Callable[[], None] = lambda: None  # pure modes: grads into the fp32 masters
    diagnostics: StepObserver = field(default_factory=StepObserver)  # numerics telemetry
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn  # fp32 training loss

    uses_scaler = True  # pitfalls.HalfModel drops the scaler: its scale then means nothing

    def __post_init__(self) -> None:
        # the tensors the optimizer steps: the model's, or their fp32 masters in the pure modes
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None  # see __call__

    def __call__(self, micro_batches: Sequence[Batch], measure_norm: bool = True) -> StepResult:
        """One optimizer step; `measure_norm=False` skips the gradient norm unless clipping by
        norm needs it (the loop asks for it on log steps only)."""
        self.diagnostics.begin_step()
        model = self.diagnostics.forward_module(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.policy.device)
        correct = torch.zeros((), device=self.policy.device, dtype=torch.long)
        samples = 0
        for i, (images, labels) in enumerate(micro_batches):
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with self.micro_batch_context(i == len(micro_batches) - 1):
                with self.policy.autocast():
                    logits = model(images)
                # dividing by the number of micro-batches makes accumulation an average
                loss = self.loss(logits, labels) / len(micro_batches)
                # The previous logits and loss (with its spent graph) are freed here, as a
                # hand-written loop frees them by reassigning its variables. Freed at return
                # instead, they moved the next step's tensors in the CPU heap, and test_vit's
                # steps ran ~2% slower (docs/benchmarks.md).
                self.held = (logits, loss)
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
            correct += count_correct(logits, labels)
            samples += labels.shape[0]
        grad_norm = self.unscale_and_clip(measure_norm)
        self.diagnostics.before_optimizer_step()
        self.scaler.step(self.optimizer)
        found_inf = skipped_update(self.scaler, self.optimizer)  # before update() clears it
        self.scaler.update()
        self.scheduler.step()
        result = StepResult(loss_sum, correct, samples, grad_norm, found_inf)
        self.diagnostics.end_step(result)
        return result

    def unscale_and_clip(self, measure_norm: bool = True) -> torch.Tensor | None:
        """Unscale first, so the norm and the clip threshold see the true gradients."""
        self.before_unscale()
        self.scaler.unscale_(self.optimizer)
        return self.norm_and_clip(measure_norm)

    def norm_and_clip(self, measure_norm: bool = True) -> torch.Tensor | None:
        """The total gradient norm (before clipping) when asked or clipping by norm, then clip
        by norm or value if asked."""
        clip_norm = self.clip_grad > 0 and self.clip_mode == "norm"
        norm = None
        if measure_norm or clip_norm:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if clip_norm:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.clip_grad, norm, foreach=True)
        elif self.clip_grad > 0:
            torch.nn.utils.clip_grad_value_(self.params, self.clip_grad, foreach=True)
        return None if norm is None else norm.float()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], policy: PrecisionPolicy,
             channels_last: bool = False) -> dict[str, float]:
    """Mean val loss and accuracy under the run's own autocast policy."""
    model.eval()
    loss_sum = torch.zeros((), device=policy.device)
    correct = torch.zeros((), device=policy.device, dtype=torch.long)
    count = 0
    for images, labels in batches:
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with policy.autocast():
            logits = model(images)
        loss_sum += loss_fn(logits, labels) * labels.shape[0]
        correct += count_correct(logits, labels)
        count += labels.shape[0]
    model.train()
    return {"val/loss": loss_sum.item() / count, "val/acc": correct.item() / count}


def take(iterator: Iterator[Batch], n: int) -> list[Batch]:
    """The next n micro-batches (fewer at the end of an epoch)."""
    batches = []
    for batch in iterator:
        batches.append(batch)
        if len(batches) == n:
            break
    return batches
