"""One forward and backward pass of a built run on one batch, every module's tensors kept as
fp32 copies. A compiled step runs without hooks (a hook's copy would change what the compiler
fuses): it keeps logits, loss and parameter gradients."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from amp_lab.diagnostics.module_probe import ModuleProbe
from amp_lab.precision.scaler_internals import overflow_update
from amp_lab.precision.scaling import allowed_holds
from amp_lab.run import Run
from amp_lab.tools import probe
from amp_lab.tools.numerics.bands import unit_roundoff

Batch = tuple[torch.Tensor, torch.Tensor]
Entry = tuple[str, str, torch.Tensor]  # (module, dtype as torch spells it, fp32 copy)


@dataclass
class Capture:
    """What one pass computed, every tensor an fp32 copy on the run's device."""

    logits: torch.Tensor
    loss: float
    scale: float  # the loss scale backward ran with
    compute: str  # the run's compute dtype (torch's name): its GEMMs cast their inputs to it
    params: dict[str, torch.Tensor]  # parameter name -> its unscaled gradient
    forward: list[Entry] = field(default_factory=list)  # module outputs, in call order
    inputs: list[torch.Tensor | None] = field(default_factory=list)  # their inputs, likewise
    backward: list[Entry] = field(default_factory=list)  # input gradients, in backward order
    roundings: list[float] = field(default_factory=list)  # per forward call: u of its rounding
    terms: dict[str, int] = field(default_factory=dict)  # parameter -> terms in its gradient's sums


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32, copy=True)


def first_batch(run: Run) -> Batch:
    """The run's first training batch (before mixup: the finder compares numerics, not data)."""
    return probe.first_micro_batches(run, mixed=False)[0]


def _rounding(module: torch.nn.Module, entry: Entry, given: torch.Tensor | None) -> float:
    """The unit roundoff a module's own computation adds: its output dtype's for a leaf that
    changed its input (torchao's float8 Linear: e4m3's), none for a container."""
    _, dtype, output = entry
    if next(module.children(), None) is not None:
        return 0.0
    if given is not None and given.shape == output.shape and torch.equal(given, output):
        return 0.0
    if type(module).__name__ == "Float8Linear":
        return unit_roundoff("torch.float8_e4m3fn")
    return unit_roundoff(dtype)


def reduction_lengths(model: torch.nn.Module, forward: list[Entry], batch: int) -> dict[str, int]:
    """Per parameter, the terms summed into each element of its gradient: its module's outputs'
    size over its leading dimension (output features); the batch for the model's own."""
    outputs: dict[str, int] = {}
    for name, _, tensor in forward:
        outputs[name] = outputs.get(name, 0) + tensor.numel()
    terms = {}
    for name, p in model.named_parameters():
        owner = name.rpartition(".")[0]
        features = p.shape[0] if p.dim() else 1
        terms[name] = max(outputs[owner] // features, 1) if owner in outputs else batch
    return terms


def _pass(
    run: Run, batch: Batch, scaled: bool, probe: ModuleProbe | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward (the loss scaled if `scaled`), the seed reset for the same dropout."""
    step = run.train_step
    step.step_number = 1  # the run's first step (fault.* injections count from 1)
    torch.manual_seed(run.settings.trainer.seed)
    step.optimizer.zero_grad(set_to_none=True)
    if probe is not None:
        probe.calls = {"forward": [], "backward": []}
        probe.inputs, probe.grad_owner = [], {}
        probe.attach()
    try:
        logits, loss = step.forward_and_loss(step.model, *batch, 1, True)
    finally:
        if probe is not None:
            probe.detach()
    (run.scaler.scale(loss) if scaled else loss).backward()
    return logits.detach(), loss.detach()


def _grads_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def capture(run: Run, batch: Batch, hooks: bool = True) -> Capture:
    """The run's forward and backward on `batch`; with `hooks`, every module's tensors too."""
    step = run.train_step
    scaled = step.uses_scaler and run.scaler.is_enabled()
    probe = ModuleProbe(run.model, run.device, measure=_copy, inputs=True) if hooks else None
    run.model.train()
    held = 0  # overflows in a row the scale was kept through
    while True:
        scale = float(run.scaler.get_scale()) if scaled else 1.0
        logits, loss = _pass(run, batch, scaled, probe)
        # overflowing gradients of a finite loss: the scale moves by the scaler's own rule and
        # the pass reruns; below 1 a scale lifts nothing, and a static scaler never backs off
        if not (scale > 1.0 and bool(torch.isfinite(loss)) and not _grads_finite(run.model)):
            break
        overflow_update(run.scaler, step.optimizer)
        held = held + 1 if run.scaler.get_scale() == scale else 0
        if held > allowed_holds(run.settings.scaler):
            break
    params = {
        name: p.grad.detach().float() / scale
        for name, p in run.model.named_parameters()
        if p.grad is not None
    }
    mode = run.policy.mode
    compute = str(mode.autocast_dtype or mode.param_dtype)
    got = Capture(_copy(logits), float(loss), scale, compute, params)
    if probe is not None:
        modules = dict(run.model.named_modules())
        got.forward = [(name, dtype, t) for t, name, dtype in probe.calls["forward"]]
        got.inputs = list(probe.inputs or [])
        got.backward = [(name, dtype, t / scale) for t, name, dtype in probe.calls["backward"]]
        got.roundings = [
            _rounding(modules[e[0]], e, given) for e, given in zip(got.forward, got.inputs)
        ]
        got.terms = reduction_lengths(run.model, got.forward, len(batch[1]))
    return got
