"""A skipped first step under the runner is torch's own skipped step, and so is the step after.

The run is built twice from one real config and seed with `build` (the same model, data,
optimizer and schedule, with every hook the build puts on them); the first trains through
amp_lab's TrainStep with `fault.inf_grad_at_step=1`, the second through torch's textbook recipe
(`scaler.scale(loss).backward(); scaler.unscale_(opt); scaler.step(opt); scaler.update()`, then
the schedule's step) with the same inf injected in step 1. torch always calls `optimizer.step()`
on a fused or amp-aware optimizer and lets it skip itself, so it creates the optimizer state,
fires the step hooks and, with stochastic rounding, draws random numbers; the runner must do the
same, or the clean step 2 after it trains other weights.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import settings
from torch.amp import GradScaler

from amp_lab.build import build
from amp_lab.precision.scaling import uses_dynamic_scaling
from amp_lab.run import Run

CASES = {
    "fp16_fused_adamw": ["precision=fp16"],
    "bf16_moments_stochastic": [
        "precision=fp16",
        "optim.state_dtype=bf16",
        "optim.state_rounding=stochastic",
    ],
    "bf16_pure_stochastic_updates": [
        "precision=bf16_pure",
        "precision.master_weights=false",
        "precision.update_rounding=stochastic",
    ],
}


def _build(tmp_path, *overrides: str) -> Run:
    """The run of the real config, as `python -m amp_lab` builds it."""
    return build(settings(*overrides, "fault.inf_grad_at_step=1"), tmp_path)


def _count_step_hooks(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    calls = {"pre": 0, "post": 0}

    def pre(*_):
        calls["pre"] += 1

    def post(*_):
        calls["post"] += 1

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
    return calls


def _torchs_recipe(run: Run, scaler: GradScaler, batch, inf: bool, new_scale: float | None) -> None:
    """One step of torch's AMP recipe and the schedule's step; `inf` puts an inf into the
    logits' gradient. `new_scale`: the scale a fixed-scale loop hands update()."""
    images, labels = batch
    run.optimizer.zero_grad(set_to_none=True)
    with run.policy.autocast():
        logits = run.model(images)
    if inf:
        logits.register_hook(lambda g: g * math.inf)
    loss = F.cross_entropy(logits.float(), labels)
    scaler.scale(loss).backward()
    scaler.unscale_(run.optimizer)
    scaler.step(run.optimizer)
    scaler.update(new_scale)
    run.scheduler.step()


def _params(run: Run) -> list[torch.Tensor]:
    return [p for g in run.optimizer.param_groups for p in g["params"]]


def _assert_same_training_state(runner: Run, textbook: Run, steps: int) -> None:
    for a, b in zip(runner.model.parameters(), textbook.model.parameters(), strict=True):
        assert torch.equal(a, b)
    a_params, b_params = _params(runner), _params(textbook)
    assert len(runner.optimizer.state) == len(a_params)  # a state for every parameter
    for a, b in zip(a_params, b_params, strict=True):
        a_state, b_state = runner.optimizer.state[a], textbook.optimizer.state[b]
        assert a_state.keys() == b_state.keys()
        for key in a_state:
            assert torch.equal(a_state[key], b_state[key]), key
        assert a_state["step"].item() == steps  # the skipped step is not counted


@pytest.mark.parametrize("case", CASES)
def test_a_skipped_first_step_is_torchs_skipped_step(tmp_path, case):
    runner = _build(tmp_path / "runner", *CASES[case])
    textbook = _build(tmp_path / "torch", *CASES[case])
    for a, b in zip(runner.model.parameters(), textbook.model.parameters(), strict=True):
        assert torch.equal(a, b)  # two builds of one config and seed: the same start
    cfg = runner.settings.scaler
    dynamic = uses_dynamic_scaling(cfg, runner.policy)
    scaler = GradScaler(
        runner.device.type,
        init_scale=runner.scaler.get_scale(),
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval,
    )
    runner_hooks, textbook_hooks = (_count_step_hooks(p.optimizer) for p in (runner, textbook))
    images, labels = runner.data.train.tensors
    torch.manual_seed(0)
    rng = dict.fromkeys(["runner", "torch"], torch.get_rng_state())  # each side's own stream
    for step in (1, 2):  # the inf in step 1, a clean step 2
        batch = images[16 * step : 16 * (step + 1)], labels[16 * step : 16 * (step + 1)]
        torch.set_rng_state(rng["runner"])
        result = runner.train_step([batch], step=step)
        rng["runner"] = torch.get_rng_state()
        torch.set_rng_state(rng["torch"])
        _torchs_recipe(textbook, scaler, batch, step == 1, None if dynamic else scaler.get_scale())
        rng["torch"] = torch.get_rng_state()
        assert result.found_inf.item() == float(step == 1)
        assert runner_hooks == textbook_hooks == {"pre": step, "post": step}
        assert torch.equal(rng["runner"], rng["torch"])
        assert runner.scaler.get_scale() == scaler.get_scale()
        _assert_same_training_state(runner, textbook, step - 1)
    assert runner.scaler.get_scale() == (cfg.init_scale * cfg.backoff_factor if dynamic else 1.0)
