"""At scaler.hysteresis=1, with min_scale and max_scale out of reach, HysteresisGradScaler is
torch's GradScaler bit for bit, whatever the growth and backoff factors.

Two copies of timm's test_vit train side by side, one under torch's GradScaler, one under
amp_lab's, with inf and nan gradients injected on a fixed pattern of steps; every step the scale,
the growth tracker, the weights and the optimizer state must be equal to the bit. The factors are
not powers of two, so every change of the scale rounds. Each scaler also loads the other's
state dict.
"""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
from torch.amp import GradScaler

from amp_lab.precision.scaling import HysteresisGradScaler

GROWTH, BACKOFF = 1.7, 0.37
STEPS = 200
# What the gradients hold at each step of a 16-step cycle: clean (None), inf or nan; runs of 5 and
# 8 clean steps, one overflow and then two in a row. The scale falls from 2**16 to about 2**-2
# while growth_interval is 3, and climbs a little once it is 2.
CYCLE = ["inf", *[None] * 5, "nan", "inf", *[None] * 8]
# growth_interval drops from 3 to 2 here, where the count of clean steps stands at 2: torch
# grows only when the count equals the interval, so its scale then waits for the next overflow
INTERVAL_DROP_AT = 106


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("test_vit", pretrained=False, num_classes=10, img_size=16, depth=1)


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
}


def _step(model, optimizer, scaler, images, labels, fault: str | None) -> None:
    """The runner's order of one step: scale, backward, unscale, step, update."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(images)
    if fault is not None:
        value = math.inf if fault == "inf" else math.nan
        logits.register_hook(lambda g: g * value)
    scaler.scale(torch.nn.functional.cross_entropy(logits, labels)).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def _assert_same(step: int, pairs) -> None:
    (a_model, b_model), (a_opt, b_opt), (a_scaler, b_scaler) = pairs
    where = f"after step {step}"
    assert a_scaler.get_scale() == b_scaler.get_scale(), where
    assert a_scaler._get_growth_tracker() == b_scaler._get_growth_tracker(), where
    for (name, a), b in zip(a_model.named_parameters(), b_model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} {where}"
        a_state, b_state = a_opt.state[a], b_opt.state[b]
        assert a_state.keys() == b_state.keys(), where
        for key in a_state:
            assert torch.equal(a_state[key], b_state[key]), f"{name} {key} {where}"


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_hysteresis_one_trains_bit_for_bit_as_torchs_scaler(optimizer):
    torch_model = _model()
    ours_model = copy.deepcopy(torch_model)
    torch_opt = OPTIMIZERS[optimizer](torch_model.parameters())
    ours_opt = OPTIMIZERS[optimizer](ours_model.parameters())
    torch_scaler = GradScaler(
        "cpu", init_scale=2.0**16, growth_factor=GROWTH, backoff_factor=BACKOFF, growth_interval=3
    )
    ours_scaler = HysteresisGradScaler(
        "cpu", 2.0**16, GROWTH, BACKOFF, 3, hysteresis=1, min_scale=1e-30, max_scale=math.inf
    )
    generator = torch.Generator().manual_seed(1)
    scales = set()
    for step in range(STEPS):
        if step == INTERVAL_DROP_AT:
            assert torch_scaler._get_growth_tracker() == 2  # the case the drop is there for
            torch_scaler.set_growth_interval(2)
            ours_scaler.set_growth_interval(2)
        images = torch.randn(4, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 10, (4,), generator=generator)
        fault = CYCLE[step % len(CYCLE)]
        _step(torch_model, torch_opt, torch_scaler, images, labels, fault)
        _step(ours_model, ours_opt, ours_scaler, images, labels, fault)
        _assert_same(
            step,
            [(torch_model, ours_model), (torch_opt, ours_opt), (torch_scaler, ours_scaler)],
        )
        scales.add(torch_scaler.get_scale())
    # the run did what it is for: many scales, none of them a power of two after the first
    assert len(scales) > 20
    assert sum(math.log2(s).is_integer() for s in scales) <= 1


def test_the_scale_grows_to_the_float_max_and_no_further_as_torchs_does():
    """Near fp32's largest value: torch keeps the scale when growing would make it inf."""
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    torch_scaler = GradScaler("cpu", init_scale=2.0**125, growth_factor=GROWTH, growth_interval=1)
    ours = HysteresisGradScaler("cpu", 2.0**125, GROWTH, 0.5, 1, 1, 1e-30, math.inf)
    seen = []
    for step in range(12):
        for scaler in (torch_scaler, ours):
            scaler.scale(weight.sum())  # creates the scale tensor on first use
            weight.grad = torch.full((4,), math.inf if step == 8 else 1.0)
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        assert ours.get_scale() == torch_scaler.get_scale()
        assert ours._get_growth_tracker() == torch_scaler._get_growth_tracker() == 0
        seen.append(torch_scaler.get_scale())
    assert math.isfinite(max(seen)) and max(seen) * GROWTH > torch.finfo(torch.float32).max
    assert seen[7] == seen[3]  # held at the top for several steps, then backed off at step 8
    assert seen[8] == seen[7] * 0.5


def _scale_after(scaler: GradScaler, overflows: list[bool]) -> list[float]:
    """The scale after each step, the gradients inf where `overflows` says."""
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    seen = []
    for overflow in overflows:
        scaler.scale(weight.sum())  # creates the scale tensor on first use
        weight.grad = torch.full((4,), math.inf if overflow else 1.0)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        seen.append(scaler.get_scale())
    return seen


def test_the_hysteresis_scaler_loads_torchs_state_with_its_count_full():
    theirs = GradScaler("cpu", init_scale=2.0**10, growth_factor=GROWTH, growth_interval=4)
    _scale_after(theirs, [True, False, False])  # backed off once, two clean steps since
    ours = HysteresisGradScaler("cpu", 8.0, 2.0, 0.5, 100, 3, 1e-30, math.inf)
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == theirs.get_scale() == 2.0**9
    assert ours._get_growth_tracker() == 2 and ours.get_growth_interval() == 4
    assert ours.get_growth_factor() == GROWTH
    assert ours.state_dict()["_hysteresis_tracker"] == 3 and not ours.floor_reached()
    # three overflows in a row before a backoff: the count of them started full
    assert _scale_after(ours, [True, True, True]) == [2.0**9, 2.0**9, 2.0**8]


def test_torchs_scaler_loads_the_hysteresis_scalers_state():
    ours = HysteresisGradScaler("cpu", 2.0**10, GROWTH, 0.5, 4, 2, 1e-30, math.inf)
    _scale_after(ours, [True, True, False])  # the second overflow backed off, one clean step
    theirs = GradScaler("cpu", init_scale=8.0, growth_interval=100)
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == ours.get_scale() == 2.0**9
    assert theirs._get_growth_tracker() == 1 and theirs.get_growth_interval() == 4
    assert theirs.get_growth_factor() == GROWTH
    # torch's semantics from here on: each overflow backs off
    assert _scale_after(theirs, [True, True]) == [2.0**8, 2.0**7]
