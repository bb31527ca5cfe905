"""LR scaling rules, warmup shapes and schedules, read off the real scheduler at chosen steps."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers import settings

from amp_lab.build import build
from amp_lab.components.lr import build_scheduler, peak_lr, warmup_length
from amp_lab.config import LRConfig
from amp_lab.trainer import Trainer


def _lrs(cfg: LRConfig, total: int, steps_per_epoch: int = 10, peak: float = 1.0) -> list[float]:
    """The LR the optimizer uses at each step 0..total-1."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = build_scheduler(optimizer, cfg, total, steps_per_epoch)
    values = []
    for _ in range(total):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


@pytest.mark.parametrize(
    "rule,batch,grad_accum,expected",
    [
        ("none", 64, 1, 1e-3),
        ("linear", 64, 1, 1e-3 * 64 / 256),
        ("linear", 64, 8, 1e-3 * 512 / 256),  # accumulation counts towards the global batch
        ("sqrt", 64, 1, 1e-3 * math.sqrt(64 / 256)),
        ("sqrt", 128, 4, 1e-3 * math.sqrt(512 / 256)),
    ],
)
def test_batch_size_rules(rule, batch, grad_accum, expected):
    cfg = settings(
        f"lr.rule={rule}", f"trainer.batch_size={batch}", f"trainer.grad_accum={grad_accum}"
    )
    assert peak_lr(cfg.lr, batch * grad_accum) == pytest.approx(expected)
    assert peak_lr(LRConfig(rule=rule, scale=0.7), batch * grad_accum) == pytest.approx(
        0.7 * expected
    )


def test_linear_warmup_then_cosine():
    lrs = _lrs(LRConfig(warmup_steps=4, warmup_init=0.2, schedule="cosine"), total=12)
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lrs[8] == pytest.approx((1 + math.cos(math.pi * 4 / 8)) / 2)  # half-way: 0.5
    assert lrs[11] == pytest.approx((1 + math.cos(math.pi * 7 / 8)) / 2)


def test_cosine_warmup_shape():
    lrs = _lrs(LRConfig(warmup_steps=4, warmup_type="cosine", schedule="constant"), total=8)
    assert lrs[:5] == pytest.approx(
        [0.0, (1 - math.cos(math.pi / 4)) / 2, 0.5, (1 - math.cos(3 * math.pi / 4)) / 2, 1.0]
    )
    assert lrs[4:] == pytest.approx([1.0] * 4)


def test_warmup_epochs_count_optimizer_steps():
    cfg = LRConfig(warmup_epochs=1.5)
    assert warmup_length(cfg, steps_per_epoch=10) == 15
    assert warmup_length(LRConfig(warmup_epochs=1.5, warmup_steps=3), 10) == 3


def test_onecycle_ramps_then_anneals_linearly():
    lrs = _lrs(LRConfig(schedule="onecycle", min_factor=0.1), total=10)  # 30% ramp: 3 steps
    assert lrs[:4] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    assert lrs[9] == pytest.approx(1.0 - 0.9 * 6 / 7)


def test_step_schedule():
    lrs = _lrs(LRConfig(schedule="step", step_every=3, step_gamma=0.5), total=9)
    assert lrs == pytest.approx([1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25])


def test_cosine_ends_at_min_factor_and_scales_with_peak():
    lrs = _lrs(LRConfig(schedule="cosine", min_factor=0.1), total=101, peak=2e-3)
    assert lrs[0] == pytest.approx(2e-3)
    assert lrs[100] == pytest.approx(2e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi * 100 / 101)) / 2))


def test_a_warmup_as_long_as_the_run_is_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="amp_lab.build"):
        Trainer(build(settings("lr.warmup_steps=100"), tmp_path))  # the fast run has 6 steps
    assert "the LR warmup (100 steps) is as long as the run (6 steps)" in caplog.text
