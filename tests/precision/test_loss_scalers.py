"""scaler=hysteresis (Megatron/DeepSpeed semantics) and scaler=static on real configs."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import settings
from helpers.resume import RUN
from helpers.resume import curve as _curve
from helpers.resume import interrupt as _interrupt

from amp_lab.build import build
from amp_lab.config import ConfigError
from amp_lab.precision.scaling import HysteresisGradScaler, StaticGradScaler
from amp_lab.trainer import Trainer

# fp32 with the scaler forced on: the scaler logic is the same as under fp16, and fast on CPU
HYST = ["precision=fp32", "scaler=hysteresis", "scaler.enabled=true"]


def _batch(trainer: Trainer, offset: int = 0):
    images, labels = trainer.run.data.train.tensors
    return images[offset : offset + 16], labels[offset : offset + 16]


def _inf_grads(trainer: Trainer, steps: int | None = None):
    """The next `steps` backward passes (all, when None) put an inf into the head's gradient."""
    left = [steps]

    def hook(grad):
        if left[0] is not None:
            if left[0] == 0:
                return grad
            left[0] -= 1
        return grad * float("inf")

    return trainer.run.model.head.weight.register_hook(hook)


def _scales(trainer: Trainer, overflows: list[bool]) -> list[float]:
    scales = []
    for i, overflow in enumerate(overflows):
        handle = _inf_grads(trainer) if overflow else None
        result = trainer.run.train_step([_batch(trainer, 16 * i)])
        assert result.found_inf.item() == float(overflow)
        if handle:
            handle.remove()
        scales.append(trainer.run.scaler.get_scale())
    return scales


def test_hysteresis_backs_off_only_on_the_nth_consecutive_overflow(tmp_path):
    trainer = Trainer(
        build(settings(*HYST, "scaler.init_scale=1024", "scaler.hysteresis=3"), tmp_path)
    )
    assert isinstance(trainer.run.scaler, HysteresisGradScaler)
    overflows = [True, True, True, True, False, True, True]
    # the 3rd and 4th consecutive overflows back off; the clean step resets the count
    assert _scales(trainer, overflows) == [1024, 1024, 512, 256, 256, 256, 256]


def test_hysteresis_grows_up_to_max_scale(tmp_path):
    trainer = Trainer(
        build(
            settings(
                *HYST, "scaler.init_scale=4", "scaler.growth_interval=2", "scaler.max_scale=8"
            ),
            tmp_path,
        )
    )
    assert _scales(trainer, [False] * 5) == [4, 8, 8, 8, 8]


def test_min_scale_stops_the_run_as_diverged(tmp_path):
    trainer = Trainer(
        build(
            settings(
                *HYST,
                "scaler.init_scale=4",
                "scaler.hysteresis=1",
                "scaler.min_scale=1",
                "trainer.max_steps=20",
                "trainer.log_every=2",
                "health.max_bad_steps=50",
            ),
            tmp_path,
        )
    )
    _inf_grads(trainer)  # every step overflows: 4 -> 2 -> 1 -> a backoff due at the floor
    summary = trainer.fit()
    assert summary["diverged"] is True and summary["status"] == "diverged"
    assert summary["steps"] == 4  # the floor is hit at step 3, seen at the step-4 log
    assert summary["final_loss_scale"] == 1.0 and summary["skipped_steps"] == 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["amp/loss_scale"] for r in rows if r["kind"] == "train"] == [1.0, 1.0]
    assert json.loads((tmp_path / "summary.json").read_text())["diverged"] is True


def test_hysteresis_state_survives_a_state_dict_round_trip(tmp_path):
    first = Trainer(build(settings(*HYST, "scaler.init_scale=64", "scaler.hysteresis=2"), tmp_path))
    _scales(first, [True])  # one overflow: the next one backs off
    state = first.run.scaler.state_dict()
    assert state["_hysteresis_tracker"] == 1 and state["scale"] == 64.0
    second = Trainer(
        build(settings(*HYST, "scaler.init_scale=1024", "scaler.hysteresis=5"), tmp_path / "b")
    )
    second.run.scaler.load_state_dict(state)  # before its first step, as a resume does
    assert _scales(second, [True]) == [32.0]
    assert second.run.scaler.state_dict()["hysteresis"] == 2


def test_static_scaler_keeps_its_scale(tmp_path):
    trainer = Trainer(
        build(
            settings(
                "precision=fp16",
                "scaler=static",
                "scaler.init_scale=256",
                "scaler.growth_interval=1",
            ),
            tmp_path,
        )
    )
    assert isinstance(trainer.run.scaler, StaticGradScaler)
    before = [p.detach().clone() for p in trainer.run.model.parameters()]
    assert _scales(trainer, [False, True, False]) == [256, 256, 256]
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.run.model.parameters()))
    assert trainer.run.describe()["scaler"]["dynamic"] is False


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["scaler.kind=megatron"], "scaler.kind='megatron' is unknown"),
        (["scaler=hysteresis", "scaler.hysteresis=0"], "scaler.hysteresis=0 must be >= 1"),
        (
            ["scaler=hysteresis", "scaler.min_scale=2048", "scaler.init_scale=1024"],
            "must lie between scaler.min_scale",
        ),
        (["scaler=hysteresis", "scaler.max_scale=0.5"], "must be <= scaler.max_scale=0.5"),
    ],
)
def test_bad_scaler_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        settings(*overrides)
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        [
            "precision=fp16",
            "scaler=hysteresis",
            "scaler.init_scale=1024",
            "scaler.growth_interval=3",
        ],
        ["precision=bf16_pure"],
        [
            "precision=bf16_pure",
            "precision.master_weights=false",
            "precision.update_rounding=kahan",
        ],
    ],
    ids=["fp16_hysteresis", "bf16_pure", "bf16_kahan"],
)
def test_resumed_run_equals_uninterrupted_run(tmp_path, overrides):
    """Checkpoints hold the hysteresis state, the fp32 masters and the Kahan buffers."""
    whole = Trainer(build(settings(*RUN, *overrides), tmp_path / "whole"))
    whole.fit()
    _interrupt(tmp_path / "split", [*RUN, *overrides], at_step=5)
    resumed = Trainer(build(settings(*RUN, *overrides), tmp_path / "split"))
    assert resumed.run.state.step == 5
    resumed.fit()
    assert _curve(tmp_path / "split") == _curve(tmp_path / "whole")
    for a, b in zip(
        whole.run.optimizer.state_dict()["state"].values(),
        resumed.run.optimizer.state_dict()["state"].values(),
    ):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert resumed.run.scaler.state_dict() == whole.run.scaler.state_dict()
