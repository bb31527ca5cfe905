"""The device counters and light diagnostics: one op per step each, the sums, skip streaks and
first non-finite step found at log steps."""

from __future__ import annotations

import math

import torch
from helpers import settings
from torch.utils._python_dispatch import TorchDispatchMode

from amp_lab.build import build
from amp_lab.numerics.counters import DeviceCounters
from amp_lab.step import StepResult
from amp_lab.trainer import Trainer


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _result(loss: float, correct: int, skip: float | None) -> StepResult:
    found = 0 if skip is None else torch.tensor(skip)  # 0: a step without a scaler
    return StepResult(torch.tensor(loss), torch.tensor(correct), 8, None, found)


def test_a_step_costs_one_op():
    counters = DeviceCounters(torch.device("cpu"), log_every=4)
    results = [_result(1.0, 3, 0.0), _result(2.0, 1, None)]
    with OpCount() as count:
        for result in results:
            counters.add(result)
    assert count.ops == ["aten._foreach_copy_.default"] * 2


def test_sums_skip_streaks_and_nan_losses_over_windows_and_checkpoints():
    """The same figures as adding step by step: nan losses counted apart, the streak of skipped
    steps carried across windows, the worst streak per window."""
    counters = DeviceCounters(torch.device("cpu"), log_every=4)
    steps = [(1.0, 2, 0.0), (math.nan, 0, 1.0), (math.nan, 0, 1.0), (3.0, 5, 0.0)]
    for step in steps:
        counters.add(_result(*step))
    first = counters.read_window()
    assert first["loss_sum"] == 4.0 and first["loss_count"] == 2 and first["correct"] == 7
    assert first["samples"] == 32 and first["skipped"] == first["window_skipped"] == 2
    assert first["streak"] == 0 and first["worst_streak"] == 2
    # a skip streak that runs on into the next window, through a checkpoint mid-window
    for step in [(2.0, 1, 0.0), (math.nan, 0, 1.0)]:
        counters.add(_result(*step))
    saved = counters.state_dict().clone()
    resumed = DeviceCounters(torch.device("cpu"), log_every=4)
    resumed.load_state_dict(saved)
    for step in [(math.nan, 0, 1.0), (math.nan, 0, 1.0)]:
        resumed.add(_result(*step))
    second = resumed.read_window()
    assert second["loss_sum"] == 2.0 and second["loss_count"] == 1 and second["samples"] == 32
    assert second["skipped"] == 5 and second["window_skipped"] == 3
    assert second["streak"] == 3 and second["worst_streak"] == 3
    for _ in range(5):  # more steps than a window (a resume mid-window): folded early
        resumed.add(_result(1.0, 1, 0.0))
    third = resumed.read_window()
    assert third["loss_count"] == 5 and third["samples"] == 40 and third["streak"] == 0


def test_light_diagnostics_and_counters_cost_one_op_each_on_a_plain_step(tmp_path):
    """Between probe steps the step launches what a hand-written loop does, plus the accuracy
    count, the schedule and one row write each for the counters and the light diagnostics."""
    trainer = Trainer(build(settings("precision=fp16", "diagnostics.every=100"), tmp_path))
    images, labels = trainer.run.data.train.tensors
    batch = [(images[:16], labels[:16])]
    trainer.run.train_step(batch, measure_norm=False, step=1)  # the first step creates the state
    diagnostics = trainer.run.train_step.diagnostics
    result = trainer.run.train_step(batch, measure_norm=False, step=2)
    with OpCount() as count:
        diagnostics.begin_step(3)
        diagnostics.before_optimizer_step()
        diagnostics.end_step(result)
        trainer.run.counters.add(result)
    assert count.ops == ["aten._foreach_copy_.default"] * 2
    # the window's first non-finite step is found when it is read (none here)
    assert diagnostics.read(3)["diag/first_nonfinite_step"] is None
