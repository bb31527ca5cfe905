"""LeanGradScaler does what torch's GradScaler does, bit for bit, with fewer host steps.

Each case trains two copies of timm's test_vit for a few steps, one with torch's GradScaler and
one with amp_lab's scaler of the same settings, with an inf gradient injected at one step. The
weights, the optimizer's moments and step counts, the scale and the skip flags must be equal to
the bit; and the lean path must really have been taken (torch's per-parameter sorting is made to
fail) or, where it cannot apply, torch's path must have been.
"""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
from helpers.host_reads import skip_on_the_device
from timm.optim import create_optimizer_v2
from torch.amp import GradScaler

from amp_lab.precision import scaler_internals
from amp_lab.precision.hysteresis import HysteresisGradScaler
from amp_lab.precision.lean import LeanGradScaler
from amp_lab.precision.scaler_internals import found_inf
from amp_lab.precision.scaling import StaticGradScaler

INF_AT = 2  # the step whose gradients hold an inf


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("test_vit", pretrained=False, num_classes=10, img_size=16)


def _train(model, optimizer, scaler, steps: int = 4) -> list[float]:
    """`steps` steps of the runner's order (unscale, clip, step, update); the skip flags."""
    torch.manual_seed(1)
    skips = []
    for step in range(steps):
        images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(images)
        if step == INF_AT:
            logits.register_hook(lambda g: g * math.inf)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        scaler.step(optimizer)
        skips.append(float(found_inf(scaler, optimizer)))
        scaler.update()
    return skips


def _optimizer(model, **kwargs) -> torch.optim.Optimizer:
    return create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05, **kwargs)


def _assert_same_state(a_model, a_opt, a_scaler, b_model, b_opt, b_scaler) -> None:
    for (name, a), b in zip(a_model.named_parameters(), b_model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs"
    for a_p, b_p in zip(a_model.parameters(), b_model.parameters(), strict=True):
        a_state, b_state = a_opt.state[a_p], b_opt.state[b_p]
        assert a_state.keys() == b_state.keys()
        for key in a_state:
            assert torch.equal(a_state[key], b_state[key]), key
    assert a_scaler.get_scale() == b_scaler.get_scale()
    assert a_scaler._get_growth_tracker() == b_scaler._get_growth_tracker()


def _torchs_sorting_fails(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("torch's per-parameter unscale ran")

    monkeypatch.setattr(GradScaler, "_unscale_grads_", fail)


class TorchFixedScale(GradScaler):
    """torch's own GradScaler held at one scale, as a loop with a fixed scale would use it."""

    def __init__(self, scale: float) -> None:
        super().__init__("cpu", init_scale=scale)
        self.fixed = scale

    def update(self, new_scale=None) -> None:
        super().update(self.fixed)


SCALERS = {
    "dynamic": (
        lambda: GradScaler("cpu", init_scale=2.0**16, growth_interval=2),
        lambda: LeanGradScaler("cpu", init_scale=2.0**16, growth_interval=2),
    ),
    "static at 1": (
        lambda: TorchFixedScale(1.0),
        lambda: StaticGradScaler("cpu", 1.0),
    ),
    "static at 1024": (
        lambda: TorchFixedScale(1024.0),
        lambda: StaticGradScaler("cpu", 1024.0),
    ),
}


@pytest.mark.parametrize("flag_on", ["host", "device"])
@pytest.mark.parametrize("kind", SCALERS)
def test_the_lean_scaler_trains_bit_for_bit_as_torchs_and_skips_the_inf_step(
    kind, flag_on, monkeypatch
):
    """Both ways of skipping: the flag read on the host (a CPU) or handed to the fused kernel
    on the device (a GPU; forced here)."""
    monkeypatch.setattr(scaler_internals, "flag_read_on_host", lambda flag: flag_on == "host")
    torch_scaler, lean_scaler = (make() for make in SCALERS[kind])
    reference = _model()
    lean = copy.deepcopy(reference)
    reference_opt, lean_opt = _optimizer(reference, fused=True), _optimizer(lean, fused=True)
    expected = _train(reference, reference_opt, torch_scaler)
    _torchs_sorting_fails(monkeypatch)  # from here on, only the lean path can unscale
    skips = _train(lean, lean_opt, lean_scaler)
    assert skips == expected == [0.0, 0.0, 1.0, 0.0]
    _assert_same_state(reference, reference_opt, torch_scaler, lean, lean_opt, lean_scaler)
    steps = {float(s["step"]) for s in lean_opt.state.values()}
    assert steps == {3.0}, "the skipped step is not counted"


def test_on_a_cpu_a_step_runs_no_per_parameter_step_count_fix_up(monkeypatch):
    """Handed the flag, torch's fused AdamW counts every step and then subtracts the flag from
    each parameter's step count (_foreach_sub_); read on the host, a clean step needs neither."""
    subtractions = []
    foreach_sub = torch._foreach_sub_
    monkeypatch.setattr(
        torch, "_foreach_sub_", lambda *a, **k: subtractions.append(1) or foreach_sub(*a, **k)
    )
    model = _model()
    optimizer = _optimizer(model, fused=True)
    assert _train(model, optimizer, StaticGradScaler("cpu", 1.0)) == [0.0, 0.0, 1.0, 0.0]
    assert subtractions == []
    skip_on_the_device(monkeypatch)
    _train(model, optimizer, StaticGradScaler("cpu", 1.0), steps=1)
    assert subtractions, "the check can fail: the device hand-over does subtract"


def test_the_hysteresis_scaler_takes_the_lean_path(monkeypatch):
    _torchs_sorting_fails(monkeypatch)
    model = _model()
    optimizer = _optimizer(model, fused=True)
    scaler = HysteresisGradScaler("cpu", 2.0**16, 2.0, 0.5, 2, 2, 1.0, 2.0**24)
    assert _train(model, optimizer, scaler) == [0.0, 0.0, 1.0, 0.0]
    assert scaler.get_scale() == 2.0**17  # the one overflow held by hysteresis, then growth


def test_a_fixed_scale_of_one_hands_back_the_loss_itself():
    loss = torch.ones((), requires_grad=True) * 2
    assert StaticGradScaler("cpu", 1.0).scale(loss) is loss
    scaled = StaticGradScaler("cpu", 8.0).scale(loss)
    assert scaled is not loss and scaled.item() == 16.0


def test_an_optimizer_without_a_fused_kernel_skips_on_the_host_flag_as_torchs_step_does():
    """foreach AdamW: torch's step() reads the flag on the host; so does the lean step on a CPU."""
    reference = _model()
    lean = copy.deepcopy(reference)
    reference_opt, lean_opt = _optimizer(reference), _optimizer(lean)
    assert not getattr(lean_opt, "_step_supports_amp_scaling", False)
    torch_scaler, lean_scaler = (
        GradScaler("cpu", growth_interval=2),
        LeanGradScaler("cpu", growth_interval=2),
    )
    expected = _train(reference, reference_opt, torch_scaler)
    assert _train(lean, lean_opt, lean_scaler) == expected == [0.0, 0.0, 1.0, 0.0]
    _assert_same_state(reference, reference_opt, torch_scaler, lean, lean_opt, lean_scaler)


def test_fp16_gradients_are_refused_as_torch_refuses_them():
    model = torch.nn.Linear(4, 2).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LeanGradScaler("cpu")
    scaler.scale(model(torch.ones(1, 4, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(optimizer)


def test_a_second_unscale_is_refused_as_torch_refuses_it():
    model = _model()
    optimizer = _optimizer(model, fused=True)
    scaler = LeanGradScaler("cpu")
    scaler.scale(model(torch.randn(2, 3, 16, 16)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
